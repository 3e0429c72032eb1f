//! Property tests: random sequences of add / schedule / commit / abort / finish / flush against
//! small pools, checking the integrity invariant after every call, that every step reads
//! exactly its requests' own KV through rows the core keeps up to date (`sim::Executor`), and
//! at the end that every request finished the way the rules say, with the outputs a
//! never-retracted run would give.

mod sim;

use std::collections::HashMap;

use proptest::prelude::*;
use scheduler_core::{
    AbortStatus, FinishReason, ForwardMode, Plan, Policy, SamplingLimits, Scheduler,
    SchedulerConfig, FUTURE_TOKEN,
};

const EOS: u32 = 0;
const VOCAB: u64 = 40;

/// The token the fake model samples as output number `index` of request `rid`. It depends on
/// nothing else, so retraction and batch shape cannot change a request's output.
fn fake_token(rid: u64, index: usize) -> u32 {
    let mut z = rid.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 29;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    (z >> 33) as u32 % VOCAB as u32
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt_len: usize,
        shared: usize,
        max_new: usize,
        ignore_eos: bool,
        priority: i64,
    },
    Step,
    Abort(usize),
    /// A step including this request failed: it is aborted and its KV never cached.
    Fail(usize),
    Finish(usize),
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..120, 0usize..3, 1usize..40, prop::bool::weighted(0.7), 0i64..30).prop_map(
            |(prompt_len, shared, max_new, ignore_eos, priority)| Op::Add {
                prompt_len, shared, max_new, ignore_eos, priority
            }
        ),
        8 => Just(Op::Step),
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
    policy: Policy,
    mixed: bool,
    radix_off: bool,
    overlap: bool,
    /// Low values under-reserve decode room on purpose, so retraction happens.
    conservativeness: f64,
}

fn setup() -> impl Strategy<Value = Setup> {
    let policy = prop_oneof![
        Just(Policy::Fcfs),
        Just(Policy::Lpm),
        Just(Policy::DfsWeight),
        Just(Policy::Lof),
        Just(Policy::Random),
        Just(Policy::Priority),
    ];
    (
        prop_oneof![Just(1usize), Just(16usize)],
        12usize..40,
        1usize..10,
        64usize..200,
        prop::option::of(1usize..6),
        policy,
        any::<bool>(),
        prop::bool::weighted(0.2),
        any::<bool>(),
        prop_oneof![Just(1.0), Just(0.3), Just(0.05)],
    )
        .prop_map(
            |(
                page_size,
                pool_pages,
                max_running,
                context_len,
                chunk_pages,
                policy,
                mixed,
                radix_off,
                overlap,
                conservativeness,
            )| {
                Setup {
                    page_size,
                    // Tiny pools: page size 1 gets a few hundred tokens, page size 16 a few pages more.
                    pool_pages: if page_size == 1 {
                        pool_pages * 8
                    } else {
                        pool_pages
                    },
                    max_running,
                    context_len,
                    chunk: chunk_pages.map(|c| c * page_size * if page_size == 1 { 8 } else { 1 }),
                    policy,
                    mixed,
                    radix_off,
                    overlap,
                    conservativeness,
                }
            },
        )
}

/// Drives a scheduler like the engine does, pipelining one extra step in overlap mode.
struct Driver {
    s: Scheduler,
    overlap: bool,
    inflight: Vec<(Plan, Vec<i64>)>,
    /// Outputs the fake model produced so far per request (committed or in flight).
    produced: HashMap<u64, usize>,
    /// What the outcomes delivered.
    outputs: HashMap<u64, Vec<u32>>,
    finished: HashMap<u64, FinishReason>,
    limits: HashMap<u64, (usize, usize, bool)>,
    stopped_by_caller: Vec<u64>,
    next_rid: u64,
    exec: sim::Executor,
}

impl Driver {
    fn check(&self) {
        if let Err(e) = self.s.check() {
            panic!("integrity: {e}");
        }
    }

    /// Schedules a step; returns false if there was nothing to run.
    fn launch(&mut self) -> bool {
        let plan = self.s.schedule();
        self.check();
        if plan.mode == ForwardMode::Idle {
            assert!(plan.rids.is_empty());
            return false;
        }
        let mut offset = 0;
        let mut tokens = Vec::with_capacity(plan.rids.len());
        for i in 0..plan.rids.len() {
            let rid = plan.rids[i] as u64;
            let n = plan.extend_lens[i] as usize;
            // Inputs are placeholders only for a decode whose previous token is in flight.
            let last_input = plan.input_ids[offset + n - 1];
            assert!(last_input != FUTURE_TOKEN || (n == 1 && i >= plan.num_extends));
            assert_eq!(plan.seq_lens[i], plan.prefix_lens[i] + n as i64);
            offset += n;
            if plan.sample[i] {
                let k = self.produced.entry(rid).or_default();
                tokens.push(fake_token(rid, *k) as i64);
                *k += 1;
            } else {
                tokens.push(-7); // ignored: a non-final chunk's sample
            }
        }
        assert_eq!(offset, plan.input_ids.len());
        assert_eq!(plan.positions.len(), offset);
        assert_eq!(plan.out_cache_loc.len(), offset);
        // Steps execute in launch order, each before anything planned after it.
        self.exec.execute(&self.s, &plan, &tokens);
        self.inflight.push((plan, tokens));
        true
    }

    fn land_one(&mut self) {
        if self.inflight.is_empty() {
            return;
        }
        let (plan, tokens) = self.inflight.remove(0);
        let out = self.s.commit(plan.id, &tokens).expect("commit in order");
        self.check();
        for (&rid, &tok) in out.rids.iter().zip(&out.tokens) {
            self.outputs.entry(rid as u64).or_default().push(tok as u32);
        }
        for f in out.finished {
            assert!(
                self.finished.insert(f.rid, f.reason.clone()).is_none(),
                "reported twice"
            );
            assert_eq!(
                f.completion_tokens,
                self.outputs.get(&f.rid).map_or(0, Vec::len)
            );
        }
    }

    fn step(&mut self) {
        // Overlap keeps one step in flight while the next is planned; an idle plan means the
        // in-flight step must land before anything else can be scheduled. As in the engine's
        // loop, a step whose commit moves rows lands before the next plan is made.
        if self.s.commit_moves_rows() {
            while !self.inflight.is_empty() {
                self.land_one();
            }
        }
        let launched = self.launch();
        let keep = if self.overlap && launched { 1 } else { 0 };
        while self.inflight.len() > keep {
            self.land_one();
            // The step still in flight read its requests' rows when it was planned: the
            // commit just made must not have changed them.
            if let Some((newest, _)) = self.inflight.last() {
                for &rid in &newest.rids {
                    let stale = self.s.request(rid as u64).and_then(|r| r.stale_row.clone());
                    assert_eq!(stale, None, "request {rid} of plan {}", newest.id);
                }
            }
        }
    }

    fn live_rid(&self, pick: usize) -> Option<u64> {
        let live: Vec<u64> = (0..self.next_rid)
            .filter(|r| self.s.request(*r).is_some_and(|q| q.finish.is_none()))
            .collect();
        (!live.is_empty()).then(|| live[pick % live.len()])
    }
}

fn run(setup: Setup, ops: Vec<Op>) {
    let cfg = SchedulerConfig {
        max_total_tokens: setup.pool_pages * setup.page_size,
        page_size: setup.page_size,
        max_running_requests: setup.max_running,
        context_len: setup.context_len,
        chunked_prefill_size: setup.chunk,
        policy: setup.policy,
        enable_mixed_chunk: setup.mixed,
        disable_radix_cache: setup.radix_off,
        schedule_conservativeness: setup.conservativeness,
        eos_token_ids: vec![EOS],
        seed: 7,
        ..SchedulerConfig::default()
    };
    let s = Scheduler::new(cfg).unwrap();
    let mut d = Driver {
        exec: sim::Executor::new(&s, fake_token),
        s,
        overlap: setup.overlap,
        inflight: Vec::new(),
        produced: HashMap::new(),
        outputs: HashMap::new(),
        finished: HashMap::new(),
        limits: HashMap::new(),
        stopped_by_caller: Vec::new(),
        next_rid: 0,
    };
    // A few shared "system prompts" so the radix tree sees real sharing.
    let shared: Vec<Vec<u32>> = (0..3)
        .map(|g| (0..48).map(|i| 1 + (g * 7 + i * 3) % 37).collect())
        .collect();
    for op in ops {
        match op {
            Op::Add {
                prompt_len,
                shared: g,
                max_new,
                ignore_eos,
                priority,
            } => {
                let rid = d.next_rid;
                let mut prompt: Vec<u32> = shared[g][..prompt_len.min(48) * (g % 2)].to_vec();
                prompt.extend((0..prompt_len).map(|i| fake_token(rid + 1000, i).max(1)));
                let limits = SamplingLimits {
                    max_new_tokens: max_new,
                    min_new_tokens: if ignore_eos { 0 } else { max_new / 4 },
                    stop_token_ids: Vec::new(),
                    ignore_eos,
                    priority,
                };
                match d.s.add_request(rid, prompt.clone(), limits) {
                    Ok(()) => {
                        d.exec.add(rid, &prompt);
                        let room = d.s.max_new_tokens_room(prompt.len());
                        d.limits
                            .insert(rid, (max_new.min(room), max_new / 4, ignore_eos));
                        d.next_rid += 1;
                    }
                    Err(e) => {
                        assert!(
                            prompt.len() > d.s.max_prompt_len(),
                            "rejected a prompt that fits: {e}"
                        );
                    }
                }
                d.check();
            }
            Op::Step => d.step(),
            Op::Abort(pick) => {
                if let Some(rid) = d.live_rid(pick) {
                    let status = d.s.abort(rid, "test".into());
                    d.check();
                    assert_ne!(status, AbortStatus::Unknown);
                    if status == AbortStatus::Removed {
                        d.finished.insert(rid, FinishReason::Abort("test".into()));
                    }
                }
            }
            Op::Fail(pick) => {
                if let Some(rid) = d.live_rid(pick) {
                    let status = d.s.fail(rid, "step failed".into());
                    d.check();
                    assert_ne!(status, AbortStatus::Unknown);
                    if status == AbortStatus::Removed {
                        d.finished
                            .insert(rid, FinishReason::Abort("step failed".into()));
                    }
                }
            }
            Op::Finish(pick) => {
                if let Some(rid) = d.live_rid(pick) {
                    assert!(d.s.finish(rid, "stop".into()));
                    d.check();
                    d.stopped_by_caller.push(rid);
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
    // Drain: everything finishes.
    let mut guard = 0;
    while d.s.has_work() {
        d.step();
        guard += 1;
        assert!(
            guard < 20_000,
            "scheduler made no progress: {:?}",
            d.s.stats()
        );
    }
    while !d.inflight.is_empty() {
        d.land_one();
    }
    d.check();
    let stats = d.s.stats();
    if std::env::var("PROPS_TRACE").is_ok() {
        let c = &stats.counters;
        eprintln!(
            "TRACE retr={} pre={} abort={} mixed={} req={} cached={} gen={}",
            c.retractions,
            c.preemptions,
            c.aborts,
            c.mixed_steps,
            c.requests,
            c.cached_tokens,
            c.generated_tokens
        );
    }
    assert_eq!(
        stats.held + stats.protected,
        0,
        "requests or locks left behind: {stats:?}"
    );
    assert!(
        stats.new_token_ratio > 0.0,
        "new_token_ratio collapsed: {stats:?}"
    );
    for rid in 0..d.next_rid {
        let reason = d
            .finished
            .get(&rid)
            .unwrap_or_else(|| panic!("request {rid} never finished"));
        let out = d.outputs.get(&rid).cloned().unwrap_or_default();
        let expected: Vec<u32> = (0..out.len()).map(|i| fake_token(rid, i)).collect();
        assert_eq!(
            out, expected,
            "request {rid}: outputs differ from an undisturbed run"
        );
        let (max_new, min_new, ignore_eos) = d.limits[&rid];
        // An EOS before the last output, where stops were allowed, should have finished it.
        let early_eos = out
            .iter()
            .take(out.len().saturating_sub(1))
            .skip(min_new)
            .any(|&t| t == EOS);
        match reason {
            FinishReason::Length(n) => {
                assert_eq!(*n, max_new);
                assert_eq!(out.len(), max_new, "request {rid}");
                assert!(ignore_eos || !early_eos, "request {rid} ran past an EOS");
            }
            FinishReason::StopToken(t) => {
                assert!(!ignore_eos && *t == EOS && out.last() == Some(&EOS));
                assert!(
                    out.len() > min_new && !early_eos,
                    "request {rid} stopped late or early"
                );
            }
            FinishReason::StopString(_) => assert!(d.stopped_by_caller.contains(&rid)),
            // Only the caller aborts: the scheduler itself never gives up on a request.
            FinishReason::Abort(m) => assert!(
                (m == "test" || m == "step failed") && out.len() <= max_new,
                "{rid}: {m}"
            ),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_invariants_and_finish_exactly(setup in setup(), ops in prop::collection::vec(op(), 1..120)) {
        run(setup, ops);
    }
}

#[test]
fn only_ignore_eos_requests_in_a_roomy_pool_all_finish_by_length() {
    let setup = Setup {
        page_size: 16,
        pool_pages: 64,
        max_running: 8,
        context_len: 512,
        chunk: Some(64),
        policy: Policy::Fcfs,
        mixed: false,
        radix_off: false,
        overlap: true,
        conservativeness: 1.0,
    };
    let ops: Vec<Op> = (0..30)
        .flat_map(|i| {
            [
                Op::Add {
                    prompt_len: 10 + i * 7,
                    shared: i % 3,
                    max_new: 5 + i,
                    ignore_eos: true,
                    priority: 0,
                },
                Op::Step,
            ]
        })
        .collect();
    run(setup, ops);
}

#[test]
fn priority_preemption_inside_a_mixed_step() {
    let setup = Setup {
        page_size: 16,
        pool_pages: 12,
        max_running: 2,
        context_len: 78,
        chunk: Some(16),
        policy: Policy::Priority,
        mixed: true,
        radix_off: false,
        overlap: false,
        conservativeness: 1.0,
    };
    let ops = vec![
        Op::Add {
            prompt_len: 18,
            shared: 1,
            max_new: 33,
            ignore_eos: false,
            priority: 0,
        },
        Op::Step,
        Op::Add {
            prompt_len: 49,
            shared: 0,
            max_new: 29,
            ignore_eos: false,
            priority: 11,
        },
    ];
    run(setup, ops);
}

#[test]
fn a_lone_decoder_waits_for_memory_held_by_an_in_flight_request() {
    // B's last token is in flight (so it is not decoding) while A cannot get a slot: A must be
    // requeued, not aborted, and the reservation ratio must not collapse.
    let setup = Setup {
        page_size: 1,
        pool_pages: 26,
        max_running: 3,
        context_len: 64,
        chunk: None,
        policy: Policy::Fcfs,
        mixed: false,
        radix_off: false,
        overlap: true,
        conservativeness: 0.3,
    };
    let ops = vec![
        Op::Add {
            prompt_len: 5,
            shared: 0,
            max_new: 16,
            ignore_eos: true,
            priority: 0,
        },
        Op::Add {
            prompt_len: 9,
            shared: 0,
            max_new: 7,
            ignore_eos: true,
            priority: 0,
        },
    ];
    run(setup, ops);
}

/// A small scheduler, a 40-token prompt and limits allowing `max_new_tokens`.
fn small_setup(
    chunk: Option<usize>,
    max_new_tokens: usize,
) -> (Scheduler, Vec<u32>, SamplingLimits) {
    let s = Scheduler::new(SchedulerConfig {
        max_total_tokens: 256,
        context_len: 128,
        chunked_prefill_size: chunk,
        eos_token_ids: vec![EOS],
        ..SchedulerConfig::default()
    })
    .expect("valid config");
    let limits = SamplingLimits {
        max_new_tokens,
        min_new_tokens: 0,
        stop_token_ids: vec![],
        ignore_eos: true,
        priority: 0,
    };
    (s, (1..=40).collect(), limits)
}

/// Runs one request's prefill, aborting (or failing) it while the step is in flight, then
/// returns how many prompt tokens a second request with the same prompt finds cached.
fn cached_after_in_flight_abort(fail: bool) -> usize {
    let (mut s, prompt, limits) = small_setup(None, 8);
    s.add_request(1, prompt.clone(), limits.clone())
        .expect("fits");
    let plan = s.schedule();
    assert_eq!(plan.rids, vec![1]);
    let status = if fail {
        s.fail(1, "step failed".into())
    } else {
        s.abort(1, "test".into())
    };
    assert_eq!(status, AbortStatus::Deferred);
    let out = s.commit(plan.id, &[7]).expect("commit");
    assert!(
        out.tokens.is_empty(),
        "an aborted request's token is dropped"
    );
    assert!(matches!(out.finished[0].reason, FinishReason::Abort(_)));
    s.check().expect("integrity");
    s.add_request(2, prompt, limits).expect("fits");
    let _ = s.schedule();
    s.request(2).expect("live").cached_tokens
}

#[test]
fn a_request_whose_step_failed_leaves_nothing_in_the_prefix_cache() {
    assert!(
        cached_after_in_flight_abort(false) > 0,
        "an abort caches the computed prefix"
    );
    assert_eq!(cached_after_in_flight_abort(true), 0);
}

/// A chunked prefill under overlap: chunk 1 commits, chunk 2's step is in flight while chunk
/// 3 is planned, then chunk 2's step fails (or not). Returns what a second request with the
/// same prompt finds cached.
fn cached_after_chunked_prefill(fail_chunk_2: bool) -> usize {
    let (mut s, prompt, limits) = small_setup(Some(16), 1);
    s.add_request(1, prompt.clone(), limits.clone())
        .expect("fits");
    let chunk_1 = s.schedule();
    assert_eq!(chunk_1.extend_lens, vec![16]);
    s.commit(chunk_1.id, &[0]).expect("commit");
    let chunk_2 = s.schedule();
    assert_eq!(chunk_2.prefix_lens, vec![16]);
    let chunk_3 = s.schedule(); // planned while chunk 2 is in flight
    assert_eq!(chunk_3.prefix_lens, vec![32]);
    if fail_chunk_2 {
        assert_eq!(s.fail(1, "step failed".into()), AbortStatus::Deferred);
    }
    s.commit(chunk_2.id, &[0]).expect("commit");
    s.commit(chunk_3.id, &[5]).expect("commit");
    s.check().expect("integrity");
    assert!(!s.has_work(), "the request is over (one token, or failed)");
    s.add_request(2, prompt, limits).expect("fits");
    let _ = s.schedule();
    s.request(2).expect("live").cached_tokens
}

#[test]
fn a_chunk_in_flight_enters_the_prefix_cache_only_once_its_step_committed() {
    assert_eq!(
        cached_after_chunked_prefill(true),
        16,
        "only chunk 1 was ever computed"
    );
    assert_eq!(cached_after_chunked_prefill(false), 39);
}
