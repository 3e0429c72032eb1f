//! Property tests of speculative decoding's bookkeeping: random workloads with n-gram drafts
//! and random, full, consistent or no acceptance, checking after every call the integrity
//! invariant (every KV page owned once), that every step reads exactly its requests' own KV
//! (drafted positions included), that the prefix cache holds only KV of committed tokens,
//! and at the end that outputs equal what the fake model gives without speculation.

use std::collections::HashMap;

use proptest::prelude::*;
use scheduler_core::{
    AbortStatus, FinishReason, ForwardMode, Plan, SamplingLimits, Scheduler, SchedulerConfig,
    FUTURE_TOKEN,
};

const EOS: u32 = 0;
const VOCAB: u32 = 12;

/// The fake model: the next token after a context depends on its last two tokens only, so
/// outputs soon repeat and n-gram drafts get accepted.
fn model(context: &[u32]) -> u32 {
    let n = context.len();
    let a = u64::from(context[n - 1]);
    let b = if n > 1 { u64::from(context[n - 2]) } else { 99 };
    let mut z = (a * 131 + b).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z ^= z >> 29;
    (z.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 40) as u32 % VOCAB
}

fn mix(h: u64, token: u32) -> u64 {
    let mut z = h ^ (u64::from(token) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

/// How the verifier treats drafts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Accept {
    /// The longest prefix the model agrees with, plus the bonus (greedy verification).
    Model,
    /// A random length up to what the model agrees with (still the model's tokens).
    RandomModel,
    /// Every draft, whatever the model says (outputs then follow the drafts).
    All,
    /// Only the bonus token.
    None,
    /// A random length, drafts taken as they are.
    Random,
}

impl Accept {
    /// Whether outputs stay what the fake model produces without speculation.
    fn consistent(self) -> bool {
        matches!(self, Accept::Model | Accept::RandomModel | Accept::None)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt_len: usize,
        shared: usize,
        max_new: usize,
        ignore_eos: bool,
    },
    Step,
    Abort(usize),
    Fail(usize),
    Finish(usize),
    Flush,
}

fn add() -> impl Strategy<Value = Op> {
    (1usize..60, 0usize..3, 1usize..50, prop::bool::weighted(0.6)).prop_map(
        |(prompt_len, shared, max_new, ignore_eos)| Op::Add {
            prompt_len,
            shared,
            max_new,
            ignore_eos,
        },
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => add(),
        10 => Just(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => (0usize..64).prop_map(Op::Fail),
        1 => (0usize..64).prop_map(Op::Finish),
        1 => Just(Op::Flush),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    page_size: usize,
    pool_pages: usize,
    max_running: usize,
    context_len: usize,
    chunk: Option<usize>,
    mixed: bool,
    radix_off: bool,
    overlap: bool,
    conservativeness: f64,
    num_draft_tokens: usize,
    min_window: usize,
    max_window: usize,
    accept: Accept,
}

fn setup() -> impl Strategy<Value = Setup> {
    let accept = prop_oneof![
        Just(Accept::Model),
        Just(Accept::RandomModel),
        Just(Accept::All),
        Just(Accept::None),
        Just(Accept::Random),
    ];
    (
        (
            prop_oneof![Just(1usize), Just(4usize), Just(16usize)],
            8usize..30,
            1usize..8,
            48usize..160,
            prop::option::of(1usize..6),
            any::<bool>(),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.2),
        ),
        (
            prop_oneof![1 => Just(1.0), 1 => Just(0.3), 2 => Just(0.05)],
            prop_oneof![Just(0usize), Just(2usize), Just(4usize), Just(9usize)],
            1usize..3,
            1usize..5,
            accept,
        ),
    )
        .prop_map(
            |(
                (page_size, pool_pages, max_running, context_len, chunk, mixed, radix_off, overlap),
                (conservativeness, num_draft_tokens, min_window, extra_window, accept),
            )| {
                let per_page = match page_size {
                    1 => 6,
                    4 => 3,
                    _ => 1,
                };
                Setup {
                    page_size,
                    pool_pages: pool_pages * per_page,
                    max_running,
                    context_len,
                    chunk: chunk.map(|c| c * page_size * per_page),
                    mixed,
                    radix_off,
                    overlap,
                    conservativeness,
                    num_draft_tokens,
                    min_window,
                    max_window: min_window + extra_window,
                    accept,
                }
            },
        )
}

/// A simulated executor and verifier: `req_to_token`, per-slot KV (a hash of the tokens it
/// was computed from, drafts included), the FutureMap, and per request the tokens it has been
/// given so far (prompt, then every token sent to a commit).
struct Executor {
    rows: Vec<Vec<i64>>,
    kv: Vec<u64>,
    future: Vec<i64>,
    seqs: HashMap<u64, Vec<u32>>,
    /// Per request: the hash of each prefix of `seqs`.
    hashes: HashMap<u64, Vec<u64>>,
}

impl Executor {
    fn new(s: &Scheduler) -> Self {
        let cfg = s.config();
        Self {
            rows: vec![vec![-1; cfg.context_len + 16]; cfg.max_running_requests],
            kv: vec![0; s.kv_buffer_size()],
            future: vec![FUTURE_TOKEN; cfg.max_running_requests],
            seqs: HashMap::new(),
            hashes: HashMap::new(),
        }
    }

    fn hash_at(&mut self, rid: u64, pos: usize) -> u64 {
        let seq = &self.seqs[&rid];
        let hashes = self.hashes.entry(rid).or_default();
        while hashes.len() <= pos {
            let prev = hashes.last().copied().unwrap_or(0);
            hashes.push(mix(prev, seq[hashes.len()]));
        }
        hashes[pos]
    }

    /// Runs `plan`; returns the tokens and accept lengths to commit.
    fn execute(
        &mut self,
        s: &Scheduler,
        plan: &Plan,
        accept: Accept,
        rng: &mut u64,
    ) -> (Vec<i64>, Vec<i64>) {
        for ((&row, &col), &slot) in plan
            .write_rows
            .iter()
            .zip(&plan.write_cols)
            .zip(&plan.write_slots)
        {
            self.rows[row as usize][col as usize] = slot;
        }
        let mut offset = 0;
        let mut chains = Vec::new();
        for i in 0..plan.rids.len() {
            let (rid, row) = (plan.rids[i] as u64, plan.req_slots[i] as usize);
            let (start, end) = (plan.prefix_lens[i] as usize, plan.seq_lens[i] as usize);
            let drafts = plan.draft_lens[i] as usize;
            assert_eq!(end - start, plan.extend_lens[i] as usize);
            assert!(drafts == 0 || (i >= plan.num_extends && end - start == 1 + drafts));
            let mut chain = Vec::new();
            let mut h = 0;
            for pos in start..end {
                let input = match plan.input_ids[offset] {
                    FUTURE_TOKEN => self.future[row],
                    id => id,
                };
                assert_eq!(plan.positions[offset], pos as i64);
                let slot = plan.out_cache_loc[offset];
                assert_eq!(self.rows[row][pos], slot, "request {rid}: row not written");
                h = if pos == start || pos < end - drafts {
                    assert_eq!(
                        input,
                        i64::from(self.seqs[&rid][pos]),
                        "request {rid}: wrong input at {pos}"
                    );
                    self.hash_at(rid, pos)
                } else {
                    assert!(
                        (0..i64::from(VOCAB)).contains(&input),
                        "a draft out of vocab"
                    );
                    mix(h, input as u32)
                };
                self.kv[slot as usize] = h;
                chain.push((input as u32, h));
                offset += 1;
            }
            chains.push(chain);
        }
        assert_eq!(offset, plan.input_ids.len());
        // Attention reads: every position below each request's sequence length.
        for (i, chain) in chains.iter().enumerate() {
            let (rid, row) = (plan.rids[i] as u64, plan.req_slots[i] as usize);
            let start = plan.prefix_lens[i] as usize;
            let own = s
                .request(rid)
                .expect("a planned request is live")
                .kv_slots
                .clone();
            for pos in 0..plan.seq_lens[i] as usize {
                let slot = self.rows[row][pos];
                assert_eq!(
                    slot,
                    i64::from(own[pos]),
                    "request {rid}: stale row at {pos}"
                );
                let want = if pos < start {
                    self.hash_at(rid, pos)
                } else {
                    chain[pos - start].1
                };
                assert_eq!(
                    self.kv[slot as usize], want,
                    "request {rid}: other KV at {pos}"
                );
            }
        }
        let (mut tokens, mut lens) = (Vec::new(), Vec::new());
        for (i, chain) in chains.iter().enumerate() {
            let (rid, row) = (plan.rids[i] as u64, plan.req_slots[i] as usize);
            if !plan.sample[i] {
                tokens.push(-7);
                lens.push(1);
                continue;
            }
            let drafts: Vec<u32> = chain[1..].iter().map(|&(t, _)| t).collect();
            let drafts = &drafts[drafts.len() - plan.draft_lens[i] as usize..];
            let start = plan.seq_lens[i] as usize - 1 - drafts.len();
            // What the model says after the committed context and each draft prefix.
            let mut context = self.seqs[&rid][..=start].to_vec();
            let mut said = vec![model(&context)];
            for &d in drafts {
                context.push(d);
                said.push(model(&context));
            }
            let agreed = drafts.iter().zip(&said).take_while(|(d, s)| d == s).count();
            *rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let roll = (*rng >> 33) as usize;
            let a = match accept {
                Accept::Model => 1 + agreed,
                Accept::RandomModel => 1 + roll % (agreed + 1),
                Accept::None => 1,
                Accept::All => 1 + drafts.len(),
                Accept::Random => 1 + roll % (drafts.len() + 1),
            };
            // Accepted drafts, then the model's token after them (the bonus).
            let run: Vec<u32> = drafts[..a - 1]
                .iter()
                .copied()
                .chain([said[a - 1]])
                .collect();
            let seq = self.seqs.get_mut(&rid).unwrap();
            assert_eq!(seq.len(), start + 1, "request {rid}: steps out of order");
            seq.extend_from_slice(&run);
            self.future[row] = i64::from(*run.last().unwrap());
            tokens.extend(run.iter().map(|&t| i64::from(t)));
            lens.push(a as i64);
        }
        (tokens, lens)
    }

    /// Every prefix-cache path holds the KV of exactly its tokens: never a rejected draft's.
    fn check_cache(&self, s: &Scheduler) {
        for (key, slots) in s.cached_paths() {
            assert_eq!(key.len(), slots.len());
            let mut h = 0;
            for (pos, (&t, &slot)) in key.iter().zip(&slots).enumerate() {
                h = mix(h, t);
                assert_eq!(
                    self.kv[slot as usize], h,
                    "cached KV at {pos} is not its token's"
                );
            }
        }
    }
}

struct Driver {
    s: Scheduler,
    exec: Executor,
    accept: Accept,
    rng: u64,
    overlap: bool,
    inflight: Vec<(Plan, Vec<i64>, Vec<i64>)>,
    outputs: HashMap<u64, Vec<u32>>,
    finished: HashMap<u64, FinishReason>,
    limits: HashMap<u64, (usize, bool)>,
    prompts: HashMap<u64, Vec<u32>>,
    next_rid: u64,
    drafted: u64,
    /// Per request, the most drafts it may propose next, by the rule of its verifies so far:
    /// after one that accepted all of its `d` drafts at least `2d`, else one more than it
    /// accepted (none yet: no cap).
    caps: HashMap<u64, usize>,
    /// Decode rows by the drafts they accepted (0: none, or no drafts).
    accepts: Vec<u64>,
}

impl Driver {
    fn check(&self) {
        if let Err(e) = self.s.check() {
            panic!("integrity: {e}");
        }
        self.exec.check_cache(&self.s);
    }

    fn launch(&mut self) -> bool {
        let plan = self.s.schedule();
        self.check();
        if plan.mode == ForwardMode::Idle {
            return false;
        }
        assert_eq!(plan.draft_lens.len(), plan.rids.len());
        let cfg = self.s.config();
        let k_max = self.s.draft_limit() as i64;
        let mut offset = 0;
        for (i, &k) in plan.draft_lens.iter().enumerate() {
            assert!(k <= k_max);
            let n = plan.extend_lens[i] as usize;
            let drafts = &plan.input_ids[offset + 1..offset + n];
            offset += n;
            if k > 0 {
                let rid = plan.rids[i] as u64;
                let r = self.s.request(rid).unwrap();
                // The drafts are what the n-gram rule finds in the committed tokens.
                let committed = &self.exec.seqs[&rid];
                assert_eq!(committed.len(), r.prompt.len() + r.output.len());
                let cap = (k_max as usize)
                    .min(self.caps.get(&rid).copied().unwrap_or(usize::MAX))
                    .min(r.limits.max_new_tokens - r.output.len() - 1)
                    .min(cfg.context_len - committed.len() - 1);
                let want = ngram_lookup(
                    committed,
                    cfg.spec_ngram_min_window,
                    cfg.spec_ngram_max_window,
                    cap,
                );
                let got: Vec<u32> = drafts.iter().map(|&t| t as u32).collect();
                assert_eq!(got, want, "request {rid}: drafts");
                // The step may commit 1 + k tokens: within the request's limits.
                assert!(r.output.len() + 1 + k as usize <= r.limits.max_new_tokens);
                assert!(
                    r.prompt.len() + r.output.len() + 1 + k as usize <= self.s.config().context_len
                );
            }
        }
        self.drafted += plan.draft_lens.iter().sum::<i64>() as u64;
        let (tokens, lens) = self
            .exec
            .execute(&self.s, &plan, self.accept, &mut self.rng);
        self.inflight.push((plan, tokens, lens));
        true
    }

    fn land_one(&mut self) {
        if self.inflight.is_empty() {
            return;
        }
        let (plan, tokens, lens) = self.inflight.remove(0);
        let out = self
            .s
            .commit_spec(plan.id, &tokens, &lens)
            .expect("commit in order");
        self.check();
        // Per request, the outcome's tokens are a prefix of what was sent, and only the
        // last of them may finish it.
        let mut sent = HashMap::new();
        let mut offset = 0;
        for (i, &a) in lens.iter().enumerate() {
            if plan.sample[i] {
                sent.insert(plan.rids[i] as u64, &tokens[offset..offset + a as usize]);
            }
            offset += a as usize;
        }
        let mut got: HashMap<u64, Vec<i64>> = HashMap::new();
        for (&rid, &tok) in out.rids.iter().zip(&out.tokens) {
            assert!(
                !self.finished.contains_key(&(rid as u64)),
                "a token after a finish"
            );
            got.entry(rid as u64).or_default().push(tok);
            self.outputs.entry(rid as u64).or_default().push(tok as u32);
        }
        for (rid, toks) in &got {
            let run = sent[rid];
            assert!(!toks.is_empty() && toks.len() <= run.len());
            assert_eq!(&run[..toks.len()], &toks[..]);
        }
        for (i, &k) in plan.draft_lens.iter().enumerate() {
            let rid = plan.rids[i] as u64;
            if plan.mode == ForwardMode::Decode && got.contains_key(&rid) {
                let accepted = lens[i] as usize - 1;
                if self.accepts.len() <= accepted {
                    self.accepts.resize(accepted + 1, 0);
                }
                self.accepts[accepted] += 1;
            }
            if k > 0 && got.contains_key(&rid) {
                let (drafts, accepted) = (k as usize, lens[i] as usize - 1);
                let cap = self.caps.entry(rid).or_insert(usize::MAX);
                *cap = if accepted == drafts {
                    (*cap).max(2 * drafts)
                } else {
                    accepted + 1
                };
            }
        }
        for f in out.finished {
            assert!(
                self.finished.insert(f.rid, f.reason.clone()).is_none(),
                "reported twice"
            );
            let n = self.outputs.get(&f.rid).map_or(0, Vec::len);
            assert_eq!(f.completion_tokens, n);
            if let Some(toks) = got.get(&f.rid) {
                if toks.len() < sent[&f.rid].len() {
                    // Cut short by a finish: the last committed token is the one that ended it.
                    assert!(matches!(
                        f.reason,
                        FinishReason::Length(_) | FinishReason::StopToken(_)
                    ));
                }
            }
        }
    }

    fn step(&mut self) {
        let launched = self.launch();
        let keep = usize::from(self.overlap && launched);
        while self.inflight.len() > keep {
            self.land_one();
        }
    }

    fn live_rid(&self, pick: usize) -> Option<u64> {
        let live: Vec<u64> = (0..self.next_rid)
            .filter(|r| self.s.request(*r).is_some_and(|q| q.finish.is_none()))
            .collect();
        (!live.is_empty()).then(|| live[pick % live.len()])
    }
}

/// The n-gram rule by brute force: the longest suffix of `min..=max` tokens that occurred
/// earlier, and up to `k` tokens after its latest earlier occurrence.
fn ngram_lookup(seq: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
    let len = seq.len();
    for n in (min..=max.min(len)).rev() {
        let suffix = &seq[len - n..];
        if let Some(s) = (0..len - n).rev().find(|&s| &seq[s..s + n] == suffix) {
            return seq[s + n..(s + n + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// What the fake model produces for `prompt` without speculation, as the core's finish rules
/// cut it.
fn reference(prompt: &[u32], max_new: usize, ignore_eos: bool) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_new {
        let t = model(&seq);
        seq.push(t);
        out.push(t);
        if t == EOS && !ignore_eos {
            break;
        }
    }
    out
}

fn run(setup: Setup, ops: Vec<Op>) {
    let cfg = SchedulerConfig {
        max_total_tokens: setup.pool_pages * setup.page_size,
        page_size: setup.page_size,
        max_running_requests: setup.max_running,
        context_len: setup.context_len,
        chunked_prefill_size: setup.chunk,
        enable_mixed_chunk: setup.mixed,
        disable_radix_cache: setup.radix_off,
        schedule_conservativeness: setup.conservativeness,
        eos_token_ids: vec![EOS],
        spec_num_draft_tokens: setup.num_draft_tokens,
        spec_ngram_min_window: setup.min_window,
        spec_ngram_max_window: setup.max_window,
        ..SchedulerConfig::default()
    };
    let s = Scheduler::new(cfg).unwrap();
    let mut d = Driver {
        exec: Executor::new(&s),
        s,
        accept: setup.accept,
        rng: 1,
        overlap: setup.overlap,
        inflight: Vec::new(),
        outputs: HashMap::new(),
        finished: HashMap::new(),
        limits: HashMap::new(),
        prompts: HashMap::new(),
        next_rid: 0,
        drafted: 0,
        caps: HashMap::new(),
        accepts: Vec::new(),
    };
    let shared: Vec<Vec<u32>> = (0..3)
        .map(|g| (0..32).map(|i| 1 + (g * 5 + i * 3) % (VOCAB - 1)).collect())
        .collect();
    for op in ops {
        match op {
            Op::Add {
                prompt_len,
                shared: g,
                max_new,
                ignore_eos,
            } => {
                let rid = d.next_rid;
                let mut prompt: Vec<u32> = shared[g][..prompt_len.min(32) * (g % 2)].to_vec();
                prompt
                    .extend((0..prompt_len).map(|i| 1 + ((rid as usize * 7 + i * i) % 11) as u32));
                let limits = SamplingLimits {
                    max_new_tokens: max_new,
                    ignore_eos,
                    ..SamplingLimits::default()
                };
                if d.s.add_request(rid, prompt.clone(), limits).is_ok() {
                    let room = d.s.max_new_tokens_room(prompt.len());
                    d.limits.insert(rid, (max_new.min(room), ignore_eos));
                    d.exec.seqs.insert(rid, prompt.clone());
                    d.prompts.insert(rid, prompt);
                    d.next_rid += 1;
                }
                d.check();
            }
            Op::Step => d.step(),
            Op::Abort(pick) | Op::Fail(pick) => {
                if let Some(rid) = d.live_rid(pick) {
                    let status = if matches!(op, Op::Abort(_)) {
                        d.s.abort(rid, "test".into())
                    } else {
                        d.s.fail(rid, "test".into())
                    };
                    d.check();
                    assert_ne!(status, AbortStatus::Unknown);
                    if status == AbortStatus::Removed {
                        d.finished.insert(rid, FinishReason::Abort("test".into()));
                    }
                }
            }
            Op::Finish(pick) => {
                if let Some(rid) = d.live_rid(pick) {
                    assert!(d.s.finish(rid, "stop".into()));
                    d.check();
                    d.finished
                        .insert(rid, FinishReason::StopString("stop".into()));
                }
            }
            Op::Flush => {
                let idle = !d.s.has_work();
                assert_eq!(d.s.flush_cache(), idle);
                d.check();
            }
        }
    }
    let mut guard = 0;
    while d.s.has_work() {
        d.step();
        guard += 1;
        assert!(guard < 20_000, "no progress: {:?}", d.s.stats());
    }
    while !d.inflight.is_empty() {
        d.land_one();
    }
    d.check();
    let stats = d.s.stats();
    assert_eq!(stats.held + stats.protected, 0, "left behind: {stats:?}");
    assert_eq!(
        stats.available + stats.evictable,
        stats.capacity,
        "slots lost: {stats:?}"
    );
    assert_eq!(stats.counters.draft_tokens, d.drafted);
    if std::env::var("PROPS_TRACE").is_ok() {
        let c = &stats.counters;
        eprintln!(
            "TRACE {:?} drafted={} accepted={} retr={} aborts={} mixed={} gen={}",
            setup.accept,
            c.draft_tokens,
            c.accepted_draft_tokens,
            c.retractions,
            c.aborts,
            c.mixed_steps,
            c.generated_tokens
        );
    }
    if setup.accept == Accept::None {
        assert_eq!(stats.counters.accepted_draft_tokens, 0);
    }
    for rid in 0..d.next_rid {
        let reason = d
            .finished
            .get(&rid)
            .unwrap_or_else(|| panic!("{rid} never finished"));
        let out = d.outputs.get(&rid).cloned().unwrap_or_default();
        let (max_new, ignore_eos) = d.limits[&rid];
        assert!(out.len() <= max_new);
        if !setup.accept.consistent() {
            continue;
        }
        let want = reference(&d.prompts[&rid], max_new, ignore_eos);
        match reason {
            FinishReason::Length(_) | FinishReason::StopToken(_) => {
                assert_eq!(
                    out, want,
                    "request {rid}: outputs differ from a run without drafts"
                );
            }
            _ => assert_eq!(out[..], want[..out.len()], "request {rid}: outputs differ"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn speculative_workloads_keep_invariants_and_outputs(
        setup in setup(),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        run(setup, ops);
    }

    /// A burst of requests into a small pool that reserves little for decoding: retraction
    /// with drafts planned and in flight.
    #[test]
    fn speculative_bursts_retract_and_resume(
        setup in setup(),
        burst in prop::collection::vec(add(), 4..14),
        ops in prop::collection::vec(op(), 0..60),
    ) {
        let setup = Setup { conservativeness: 0.05, max_running: 8, ..setup };
        run(setup, burst.into_iter().chain(ops).collect());
    }
}

/// A lone repetitive request with full acceptance: drafts are proposed and accepted, and the
/// output equals the model's.
#[test]
fn a_repetitive_request_accepts_drafts() {
    let cfg = SchedulerConfig {
        max_total_tokens: 512,
        context_len: 256,
        spec_num_draft_tokens: 5,
        eos_token_ids: vec![EOS],
        ..SchedulerConfig::default()
    };
    let s = Scheduler::new(cfg).unwrap();
    let prompt: Vec<u32> = vec![3, 5, 7, 3, 5];
    let mut d = serial_driver(s, Accept::Model, 1);
    let limits = SamplingLimits {
        max_new_tokens: 60,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    d.s.add_request(0, prompt.clone(), limits).unwrap();
    d.exec.seqs.insert(0, prompt.clone());
    let mut steps = 0;
    while d.s.has_work() {
        d.step();
        steps += 1;
    }
    assert_eq!(d.outputs[&0], reference(&prompt, 60, true));
    // Most drafts accepted (the request drafts fewer after a rejection), and a third fewer
    // steps than the 61 a token at a time would take.
    let c = d.s.stats().counters;
    assert!(c.accepted_draft_tokens * 3 > c.draft_tokens * 2, "{c:?}");
    assert!(steps <= 40, "{steps} steps for 60 tokens");
}

/// A request retracted mid-run (page pressure) resumes and reproduces its tokens.
#[test]
fn a_retracted_request_resumes_with_the_same_tokens() {
    for accept in [Accept::Model, Accept::RandomModel, Accept::None] {
        let cfg = SchedulerConfig {
            max_total_tokens: 96,
            context_len: 96,
            max_running_requests: 4,
            spec_num_draft_tokens: 6,
            schedule_conservativeness: 0.05,
            eos_token_ids: vec![EOS],
            ..SchedulerConfig::default()
        };
        let s = Scheduler::new(cfg).unwrap();
        let mut d = serial_driver(s, accept, 5);
        d.next_rid = 0;
        for rid in 0..4u64 {
            let prompt: Vec<u32> = (0..12).map(|i| 1 + ((rid * 3 + i) % 4) as u32).collect();
            let limits = SamplingLimits {
                max_new_tokens: 40,
                ignore_eos: true,
                ..SamplingLimits::default()
            };
            d.s.add_request(rid, prompt.clone(), limits).unwrap();
            d.exec.seqs.insert(rid, prompt.clone());
            d.prompts.insert(rid, prompt);
        }
        while d.s.has_work() {
            d.step();
        }
        assert!(d.s.stats().counters.retractions > 0, "{:?}", d.s.stats());
        for rid in 0..4u64 {
            let max_new = d.s.max_new_tokens_room(12).min(40);
            assert_eq!(d.outputs[&rid], reference(&d.prompts[&rid], max_new, true));
        }
    }
}

/// `commit_spec` refuses accept lengths outside 1..=1+k (and token counts that do not match
/// them) without changing anything; `commit` rejects every draft.
#[test]
fn commit_spec_checks_its_arguments() {
    let cfg = SchedulerConfig {
        max_total_tokens: 256,
        context_len: 128,
        spec_num_draft_tokens: 4,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let limits = SamplingLimits {
        max_new_tokens: 20,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    s.add_request(1, vec![5, 6, 7, 5, 6], limits).unwrap();
    let p = s.schedule();
    assert_eq!(p.draft_lens, [0]);
    assert!(
        s.commit_spec(p.id, &[7, 8], &[2]).is_err(),
        "an extend has no drafts"
    );
    s.commit_spec(p.id, &[7], &[1]).unwrap();
    let p = s.schedule();
    // [5, 6, 7] occurred at the start, followed by [5, 6] and the 7 just committed.
    assert_eq!(p.draft_lens, [3]);
    assert_eq!(p.input_ids, [7, 5, 6, 7]);
    assert_eq!(p.positions, [5, 6, 7, 8]);
    assert_eq!(p.extend_lens, [4]);
    assert_eq!(p.seq_lens, [9]);
    let before = s.stats();
    for (tokens, lens) in [
        (&[1, 2, 3, 4, 5][..], &[5][..]),
        (&[1][..], &[0][..]),
        (&[1, 2][..], &[1][..]),
        (&[1, 2][..], &[2, 1][..]),
        (&[-1, 2][..], &[2][..]),
    ] {
        assert!(s.commit_spec(p.id, tokens, lens).is_err());
    }
    assert_eq!(s.stats().available, before.available);
    s.check().unwrap();
    let out = s.commit(p.id, &[9]).unwrap();
    assert_eq!(out.tokens, [9]);
    assert_eq!(s.request(1).unwrap().kv_len(), 6);
    assert_eq!(s.stats().available, before.available + 3);
    s.check().unwrap();
}

/// A driver without overlap over `s`.
fn serial_driver(s: Scheduler, accept: Accept, rng: u64) -> Driver {
    Driver {
        exec: Executor::new(&s),
        s,
        accept,
        rng,
        overlap: false,
        inflight: Vec::new(),
        outputs: HashMap::new(),
        finished: HashMap::new(),
        limits: HashMap::new(),
        prompts: HashMap::new(),
        next_rid: 1,
        drafted: 0,
        caps: HashMap::new(),
        accepts: Vec::new(),
    }
}

/// Runs request 0 (`prompt`, 40 tokens) to the end with `accept`, after `prepare`; returns
/// the draft tokens planned and the step count.
fn drafting_run(
    prompt: &[u32],
    accept: Accept,
    prepare: impl FnOnce(&mut Scheduler),
) -> (u64, usize) {
    let cfg = SchedulerConfig {
        max_total_tokens: 512,
        context_len: 256,
        spec_num_draft_tokens: 5,
        eos_token_ids: vec![EOS],
        ..SchedulerConfig::default()
    };
    let s = Scheduler::new(cfg).unwrap();
    let mut d = serial_driver(s, accept, 1);
    let limits = SamplingLimits {
        max_new_tokens: 40,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    d.s.add_request(0, prompt.to_vec(), limits).unwrap();
    d.exec.seqs.insert(0, prompt.to_vec());
    prepare(&mut d.s);
    let mut steps = 0;
    while d.s.has_work() {
        d.step();
        steps += 1;
    }
    assert_eq!(d.outputs[&0], reference(prompt, 40, true));
    (d.s.stats().counters.draft_tokens, steps)
}

/// A request barred from speculating (a grammar's) and a draft limit of 0 plan no drafts; a
/// limit caps every draft; drafts that are always rejected back off (fewer verifies).
#[test]
fn speculation_can_be_refused_capped_and_backs_off() {
    let prompt: Vec<u32> = vec![3, 5, 7, 3, 5];
    let (free, fast) = drafting_run(&prompt, Accept::Model, |_| {});
    assert!(free > 0);
    let (barred, slow) = drafting_run(&prompt, Accept::Model, |s| {
        assert!(s.disable_speculation(0));
        assert!(!s.disable_speculation(99));
    });
    assert_eq!(barred, 0);
    assert!(fast < slow, "{fast} steps speculating, {slow} without");
    let (off, _) = drafting_run(&prompt, Accept::Model, |s| s.set_draft_limit(0));
    assert_eq!(off, 0);
    let (capped, _) = drafting_run(&prompt, Accept::Model, |s| {
        s.set_draft_limit(1);
        assert_eq!(s.draft_limit(), 1);
    });
    assert!(capped > 0 && capped <= 40);
    // Every draft rejected: without the pause each of the 39 decode steps would verify 4.
    let (rejected, _) = drafting_run(&prompt, Accept::None, |_| {});
    assert!(
        rejected > 0 && rejected < 4 * 12,
        "{rejected} drafts verified"
    );
}

/// With a draft model (`spec_draft_model`), the core drafts nothing itself: it reserves each
/// speculating request's draft positions with placeholder ids (0) for the runner to fill,
/// capped as n-gram drafts are, and commits whatever accepted run the runner reports.
#[test]
fn a_draft_model_gets_placeholder_drafts_to_fill() {
    let cfg = SchedulerConfig {
        max_total_tokens: 256,
        context_len: 128,
        spec_num_draft_tokens: 4,
        spec_draft_model: true,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let limits = SamplingLimits {
        max_new_tokens: 7,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    s.add_request(1, vec![5, 6, 7], limits).unwrap();
    let p = s.schedule();
    s.commit(p.id, &[8]).unwrap();
    let p = s.schedule();
    // No n-gram of [5, 6, 7, 8] repeats, yet three drafts are reserved.
    assert_eq!(p.draft_lens, [3]);
    assert_eq!(p.input_ids, [8, 0, 0, 0]);
    assert_eq!(p.positions, [3, 4, 5, 6]);
    let out = s.commit_spec(p.id, &[9, 10, 11], &[3]).unwrap();
    assert_eq!(out.tokens, [9, 10, 11]);
    s.check().unwrap();
    // Three tokens left: at most two drafts (the step's own token is the third).
    let p = s.schedule();
    assert_eq!(p.draft_lens, [2]);
    assert_eq!(p.input_ids, [11, 0, 0]);
    let out = s.commit_spec(p.id, &[12], &[1]).unwrap();
    assert_eq!(out.tokens, [12]);
    assert_eq!(s.request(1).unwrap().kv_len(), 7); // 11's position kept, the drafts' not
    s.check().unwrap();
}

/// A request's drafts follow its own acceptance: all of them accepted, it may draft twice as
/// many next (up to the step's limit); some rejected, one more than it kept; none kept, one
/// (after the pause).
#[test]
fn a_requests_drafts_grow_while_accepted_and_shrink_when_rejected() {
    let cfg = SchedulerConfig {
        max_total_tokens: 512,
        context_len: 256,
        spec_num_draft_tokens: 8,
        spec_draft_model: true, // placeholder drafts: the test decides what is accepted
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let limits = SamplingLimits {
        max_new_tokens: 100,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    s.add_request(1, vec![5, 6, 7], limits).unwrap();
    let p = s.schedule();
    s.commit(p.id, &[8]).unwrap();
    // (drafts planned, tokens the verify keeps): uncapped at first, then 7 kept of 7, 2 of
    // 7, 3 of 3, 0 of 6, 1 of 1.
    let steps = [(7, 8), (7, 3), (3, 4), (6, 1), (0, 1), (1, 2), (2, 3)];
    for (want, kept) in steps {
        let p = s.schedule();
        assert_eq!(p.draft_lens, [want]);
        let tokens: Vec<i64> = (0..kept).map(|t| 20 + t).collect();
        if want == 0 {
            s.commit(p.id, &tokens).unwrap(); // paused after a verify that kept nothing
        } else {
            s.commit_spec(p.id, &tokens, &[kept]).unwrap();
        }
        s.check().unwrap();
    }
    // A lower step limit caps a long run.
    s.set_draft_limit(1);
    assert_eq!(s.schedule().draft_lens, [1]);
}

/// Steps planned with a draft limit of 0 check the drafts a verify would have carried
/// against the tokens they commit (`take_shadow_accepts`): for a greedy model, exactly the
/// accepted counts that verifying every step gives (pauses and caps included), with or
/// without overlap, while the outputs stay the model's.
#[test]
fn shadow_drafts_accept_what_verifies_accept() {
    let prompts: [&[u32]; 3] = [&[3, 5, 7, 3, 5], &[1, 2, 3, 4, 5, 6], &[4, 4, 4, 9, 4, 4]];
    let run = |limit: Option<usize>, overlap: bool| {
        let cfg = SchedulerConfig {
            max_total_tokens: 1024,
            context_len: 256,
            spec_num_draft_tokens: 6,
            eos_token_ids: vec![EOS],
            ..SchedulerConfig::default()
        };
        let mut d = serial_driver(Scheduler::new(cfg).unwrap(), Accept::Model, 1);
        d.overlap = overlap;
        if let Some(limit) = limit {
            d.s.set_draft_limit(limit);
        }
        for (rid, prompt) in prompts.iter().enumerate() {
            let limits = SamplingLimits {
                max_new_tokens: 30 + 7 * rid,
                ignore_eos: true,
                ..SamplingLimits::default()
            };
            d.s.add_request(rid as u64, prompt.to_vec(), limits)
                .unwrap();
            d.exec.seqs.insert(rid as u64, prompt.to_vec());
        }
        while d.s.has_work() {
            d.step();
        }
        for (rid, prompt) in prompts.iter().enumerate() {
            assert_eq!(
                d.outputs[&(rid as u64)],
                reference(prompt, 30 + 7 * rid, true)
            );
        }
        let mut shadow = d.s.take_shadow_accepts();
        assert!(d.s.take_shadow_accepts().iter().all(|&n| n == 0), "zeroed");
        while shadow.last() == Some(&0) {
            shadow.pop();
        }
        (d.accepts, shadow)
    };
    let (verified, none) = run(None, false);
    assert!(none.is_empty(), "verifying steps keep no shadows: {none:?}");
    assert!(
        verified.len() > 2,
        "some verifies accept several drafts: {verified:?}"
    );
    for overlap in [false, true] {
        let (rows, shadow) = run(Some(0), overlap);
        assert_eq!(
            rows.iter().skip(1).sum::<u64>(),
            0,
            "plain steps accept nothing"
        );
        assert_eq!(shadow, verified, "overlap {overlap}");
    }
    // A limit of 1 verifies: no shadows.
    assert!(run(Some(1), false).1.is_empty());
}
