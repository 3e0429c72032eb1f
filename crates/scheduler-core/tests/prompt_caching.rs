//! When a prompt enters the prefix tree (SGLang's `cache_unfinished_req` after every
//! completed prefill): requests arriving while it decodes share it, a prompt computed twice
//! keeps one copy, a step that fails leaves nothing in the tree, and rows stay consistent
//! under overlap (step N+1 planned before step N commits) and retraction. The integrity
//! check runs after every call; `sim::Executor` checks what every step reads.

mod sim;

use std::collections::{HashMap, VecDeque};

use scheduler_core::{
    AbortStatus, FinishReason, ForwardMode, Outcome, Plan, Policy, ReqState, SamplingLimits,
    Scheduler, SchedulerConfig,
};

/// Output number `k` of request `rid` (the fake model; never 0, which is not EOS here anyway).
fn out_token(rid: u64, k: usize) -> u32 {
    1000 + (rid as u32) * 97 + (k as u32) * 13 % 89
}

/// A 70-token prompt: one page and six tokens with pages of 16, so its page-aligned length
/// (64) differs from its length.
fn prompt(seed: u32) -> Vec<u32> {
    (0..70).map(|i| 10 + (seed * 31 + i * 7) % 500).collect()
}

fn aligned(n: usize, page: usize) -> usize {
    n / page * page
}

fn config(page: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_total_tokens: 2048,
        page_size: page,
        max_running_requests: 8,
        context_len: 512,
        chunked_prefill_size: None,
        ..SchedulerConfig::default()
    }
}

/// Drives a scheduler like the engine does: each launched step executes (in launch order) on
/// the simulated executor, and commits come later, in order.
struct Harness {
    s: Scheduler,
    exec: sim::Executor,
    inflight: VecDeque<(Plan, Vec<i64>)>,
    produced: HashMap<u64, usize>,
    outputs: HashMap<u64, Vec<u32>>,
    plans: Vec<Plan>,
}

impl Harness {
    fn new(cfg: SchedulerConfig) -> Self {
        let s = Scheduler::new(cfg).expect("valid config");
        Self {
            exec: sim::Executor::new(&s, out_token),
            s,
            inflight: VecDeque::new(),
            produced: HashMap::new(),
            outputs: HashMap::new(),
            plans: Vec::new(),
        }
    }

    fn check(&self) {
        if let Err(e) = self.s.check() {
            panic!("integrity: {e}");
        }
    }

    fn add(&mut self, rid: u64, prompt: &[u32], max_new_tokens: usize) {
        self.add_with(rid, prompt, max_new_tokens, 0);
    }

    fn add_with(&mut self, rid: u64, prompt: &[u32], max_new_tokens: usize, priority: i64) {
        let limits = SamplingLimits {
            max_new_tokens,
            ignore_eos: true,
            priority,
            ..SamplingLimits::default()
        };
        self.s
            .add_request(rid, prompt.to_vec(), limits)
            .expect("fits");
        self.exec.add(rid, prompt);
        self.check();
    }

    /// Schedules and executes a step (left in flight); returns its plan.
    fn launch(&mut self) -> Plan {
        let plan = self.s.schedule();
        self.check();
        self.plans.push(plan.clone());
        if plan.mode == ForwardMode::Idle {
            return plan;
        }
        let sampled: Vec<i64> = plan
            .rids
            .iter()
            .zip(&plan.sample)
            .map(|(&rid, &sample)| {
                if !sample {
                    return -7;
                }
                let k = self.produced.entry(rid as u64).or_default();
                *k += 1;
                i64::from(out_token(rid as u64, *k - 1))
            })
            .collect();
        self.exec.execute(&self.s, &plan, &sampled);
        self.inflight.push_back((plan.clone(), sampled));
        plan
    }

    /// Commits the oldest step in flight.
    fn land(&mut self) -> Outcome {
        let (plan, sampled) = self.inflight.pop_front().expect("a step in flight");
        let out = self.s.commit(plan.id, &sampled).expect("commit in order");
        self.check();
        for (&rid, &token) in out.rids.iter().zip(&out.tokens) {
            self.outputs
                .entry(rid as u64)
                .or_default()
                .push(token as u32);
        }
        out
    }

    /// Runs until nothing is left, keeping one step in flight with `overlap`.
    fn run(&mut self, overlap: bool) {
        let mut guard = 0;
        while self.s.has_work() || !self.inflight.is_empty() {
            let plan = self.launch();
            let keep = usize::from(overlap && plan.mode != ForwardMode::Idle);
            while self.inflight.len() > keep {
                self.land();
            }
            guard += 1;
            assert!(guard < 10_000, "no progress: {:?}", self.s.stats());
        }
        let stats = self.s.stats();
        assert_eq!(stats.held + stats.protected, 0, "{stats:?}");
    }

    fn assert_outputs_undisturbed(&self) {
        for (&rid, out) in &self.outputs {
            let want: Vec<u32> = (0..out.len()).map(|k| out_token(rid, k)).collect();
            assert_eq!(out, &want, "request {rid}");
        }
    }

    fn tree_size(&self) -> usize {
        let stats = self.s.stats();
        stats.evictable + stats.protected
    }

    /// The `req_to_token` writes `plan` makes to request `rid`'s row, as (position, slot).
    fn row_writes(&self, plan: &Plan, rid: u64) -> Vec<(usize, u32)> {
        let row = i64::from(self.s.request(rid).expect("live").req_slot.expect("a row"));
        (0..plan.write_rows.len())
            .filter(|&i| plan.write_rows[i] == row)
            .map(|i| (plan.write_cols[i] as usize, plan.write_slots[i] as u32))
            .collect()
    }
}

/// The single row write of request `rid`'s decode at `pos`: its new slot.
fn decode_write(h: &Harness, rid: u64, pos: usize) -> Vec<(usize, u32)> {
    vec![(pos, h.s.request(rid).expect("live").kv_slots[pos])]
}

fn position(plan: &Plan, rid: u64) -> usize {
    plan.rids
        .iter()
        .position(|&r| r as u64 == rid)
        .unwrap_or_else(|| panic!("request {rid} is not in plan {}", plan.id))
}

#[test]
fn a_request_arriving_while_another_decodes_shares_its_prompt() {
    for page in [1, 16] {
        for overlap in [false, true] {
            let a = prompt(1);
            let shared = aligned(a.len(), page);
            // An identical prompt matches all of it but the last token, floored to pages.
            let identical = aligned(a.len() - 1, page);
            let mut h = Harness::new(config(page));
            h.add(1, &a, 20);
            let prefill = h.launch();
            assert_eq!(prefill.rids, vec![1]);
            if overlap {
                // A's first decode is planned while its prefill is in flight: nothing of it
                // may be in the tree yet.
                assert_eq!(h.launch().mode, ForwardMode::Decode);
                assert_eq!(h.tree_size(), 0);
            }
            h.land();
            // The prefill committed: A's page-aligned prompt is in the tree, locked by A.
            assert_eq!(h.s.stats().protected, shared, "page {page}");
            let req = h.s.request(1).expect("running");
            assert_eq!((req.state, req.prefix_len), (ReqState::Running, shared));

            // B = A's prompt plus a question, while A is still decoding.
            let mut b = a.clone();
            b.extend([3, 4, 5]);
            h.add(2, &b, 5);
            let plan = h.launch();
            let i = position(&plan, 2);
            assert_eq!(plan.prefix_lens[i] as usize, shared, "page {page}");
            assert_eq!(h.s.request(2).expect("live").cached_tokens, shared);
            h.add(3, &a, 5);
            let plan = h.launch();
            let i = position(&plan, 3);
            assert_eq!(plan.prefix_lens[i] as usize, identical);
            h.run(overlap);
            h.assert_outputs_undisturbed();
            assert_eq!(
                h.s.stats().counters.cached_tokens as usize,
                shared + identical
            );
        }
    }
}

#[test]
fn identical_prompts_prefilled_in_one_step_keep_one_copy() {
    for page in [1, 16] {
        for overlap in [false, true] {
            let a = prompt(2);
            let shared = aligned(a.len(), page);
            let mut h = Harness::new(config(page));
            h.add(1, &a, 8);
            h.add(2, &a, 8);
            let prefill = h.launch();
            assert_eq!(prefill.rids, vec![1, 2]);
            let b_before = h.s.request(2).expect("live").kv_slots[..shared].to_vec();
            if overlap {
                let next = h.launch(); // planned before the prefill commits
                assert_eq!(h.row_writes(&next, 2), decode_write(&h, 2, a.len()));
            }
            let available = h.s.stats().available;
            h.land();
            let stats = h.s.stats();
            // A's copy went into the tree (batch order: A first); B's duplicate was freed.
            assert_eq!(stats.protected, shared, "page {page}");
            assert_eq!(stats.available, available + shared, "page {page}");
            let a_slots = h.s.request(1).expect("live").kv_slots[..shared].to_vec();
            let b_req = h.s.request(2).expect("live");
            assert_eq!(b_req.kv_slots[..shared], a_slots[..]);
            assert_eq!(b_req.prefix_len, shared);
            assert_ne!(b_before, a_slots);
            // The next plan points B's row at A's slots before B reads it.
            let plan = h.launch();
            assert_eq!(plan.mode, ForwardMode::Decode);
            let rewritten: Vec<(usize, u32)> = h
                .row_writes(&plan, 2)
                .into_iter()
                .filter(|&(pos, _)| pos < shared)
                .collect();
            let want: Vec<(usize, u32)> = a_slots.iter().copied().enumerate().collect();
            assert_eq!(rewritten, want, "page {page} overlap {overlap}");
            assert!(h.row_writes(&plan, 1).iter().all(|&(pos, _)| pos >= shared));
            // Only once.
            h.land();
            let plan = h.launch();
            let pos = plan.seq_lens[position(&plan, 2)] as usize - 1;
            assert_eq!(h.row_writes(&plan, 2), decode_write(&h, 2, pos));
            h.run(overlap);
            h.assert_outputs_undisturbed();
            assert_eq!(h.outputs[&2].len(), 8);
        }
    }
}

#[test]
fn freed_duplicates_are_refilled_only_by_steps_that_run_after_their_last_reader() {
    // A and B prefill the same prompt in step N; B's decode (step N+1) is planned before N
    // commits, so it reads B's own copy. Committing N frees that copy; C's prefill in step
    // N+2 (mixed with B's decode) takes those very slots. B must read A's slots by then.
    for page in [1, 16] {
        let a = prompt(3);
        let shared = aligned(a.len(), page);
        let mut h = Harness::new(SchedulerConfig {
            enable_mixed_chunk: true,
            ..config(page)
        });
        h.add(1, &a, 8);
        h.add(2, &a, 8);
        h.launch();
        let b_copy = h.s.request(2).expect("live").kv_slots[..shared].to_vec();
        let n1 = h.launch();
        assert_eq!(n1.mode, ForwardMode::Decode);
        h.land();
        h.add(3, &prompt(4), 4);
        let n2 = h.launch();
        assert_eq!(n2.mode, ForwardMode::Mixed);
        assert_eq!(n2.rids, vec![3, 1, 2]);
        let c_slots: Vec<u32> = n2.out_cache_loc[..a.len()]
            .iter()
            .map(|&s| s as u32)
            .collect();
        assert!(
            b_copy.iter().any(|s| c_slots.contains(s)),
            "page {page}: C was meant to reuse B's freed copy"
        );
        assert_eq!(h.row_writes(&n2, 2).len(), shared + 1);
        h.run(true);
        h.assert_outputs_undisturbed();
    }
}

#[test]
fn a_prefill_step_that_fails_leaves_nothing_in_the_tree() {
    for page in [1, 16] {
        for overlap in [false, true] {
            let a = prompt(5);
            let mut h = Harness::new(config(page));
            h.add(1, &a, 8);
            h.launch();
            if overlap {
                h.launch(); // A's decode, planned while its prefill is in flight
            }
            assert_eq!(h.tree_size(), 0);
            assert_eq!(h.s.fail(1, "step failed".into()), AbortStatus::Deferred);
            h.check();
            let out = h.land();
            assert!(out.tokens.is_empty());
            assert!(matches!(out.finished[0].reason, FinishReason::Abort(_)));
            assert_eq!(h.tree_size(), 0, "page {page} overlap {overlap}");
            if overlap {
                h.land();
                assert_eq!(h.tree_size(), 0);
            }
            let stats = h.s.stats();
            assert_eq!(stats.available, stats.capacity);
            h.add(2, &a, 4);
            let plan = h.launch();
            assert_eq!(plan.prefix_lens, vec![0]);
            h.run(overlap);
        }
    }
}

#[test]
fn a_decode_step_that_fails_after_the_prefill_committed_keeps_the_prompt_shared() {
    for page in [1, 16] {
        let a = prompt(6);
        let shared = aligned(a.len(), page);
        let mut h = Harness::new(config(page));
        h.add(1, &a, 8);
        h.launch();
        h.launch(); // A's decode, in flight
        h.land(); // the prefill commits: the prompt is shared
        assert_eq!(h.s.stats().protected, shared);
        assert_eq!(h.s.fail(1, "step failed".into()), AbortStatus::Deferred);
        h.land();
        // What the committed prefill computed stays; A's own slots (its decode) are freed.
        let stats = h.s.stats();
        assert_eq!(
            (stats.evictable, stats.protected, stats.held),
            (shared, 0, 0)
        );
        h.add(2, &a, 4);
        let plan = h.launch();
        assert_eq!(plan.prefix_lens[0] as usize, aligned(a.len() - 1, page));
        h.run(false);
    }
}

#[test]
fn a_request_retracted_after_its_prompt_was_cached_resumes_from_it() {
    // Two requests decode in a pool too small for both to finish: the one with fewer outputs
    // is retracted. It frees only its own slots; its prompt stays in the tree, and its
    // re-prefill (prompt + outputs) starts from it.
    for page in [1, 16] {
        for overlap in [false, true] {
            let mut h = Harness::new(SchedulerConfig {
                max_total_tokens: 320,
                schedule_conservativeness: 0.05,
                ..config(page)
            });
            let (a, b) = (prompt(7), prompt(8));
            h.add(1, &a, 100);
            h.add(2, &b, 100);
            let mut retracted = None;
            let mut guard = 0;
            while retracted.is_none() {
                let plan = h.launch();
                if let Some(&rid) = plan.retracted.first() {
                    retracted = Some(rid as u64);
                }
                let keep = usize::from(overlap);
                while h.inflight.len() > keep {
                    h.land();
                }
                guard += 1;
                assert!(guard < 1000, "page {page}: no retraction");
            }
            let victim = retracted.expect("retracted");
            let p = h.s.request(victim).expect("live").prompt.clone();
            let req = h.s.request(victim).expect("live");
            assert_eq!(req.state, ReqState::Retracted);
            assert!(req.kv_slots.is_empty() && req.prefix_len == 0);
            // Its prompt is still cached (now evictable).
            assert!(h.s.stats().evictable >= aligned(p.len(), page));
            h.run(overlap);
            h.assert_outputs_undisturbed();
            assert_eq!(h.outputs[&victim].len(), 100);
            let resumed = h
                .plans
                .iter()
                .filter_map(|plan| {
                    let i = plan.rids.iter().position(|&r| r as u64 == victim)?;
                    (i < plan.num_extends).then(|| plan.prefix_lens[i] as usize)
                })
                .nth(1)
                .expect("the victim was prefilled again");
            assert!(
                resumed >= aligned(p.len(), page),
                "page {page}: re-prefill from {resumed}"
            );
        }
    }
}

#[test]
fn a_prompt_that_finishes_in_its_prefill_step_is_cached_once_on_release() {
    // max_new_tokens = 1: the request finishes with its prefill's token, so it is cached
    // when released (SGLang's cache_finished_req), not as an unfinished request.
    for page in [1, 16] {
        let a = prompt(9);
        let mut h = Harness::new(config(page));
        h.add(1, &a, 1);
        h.launch();
        h.land();
        let stats = h.s.stats();
        assert_eq!(
            (stats.evictable, stats.protected),
            (aligned(a.len(), page), 0)
        );
        assert_eq!(stats.available + stats.evictable, stats.capacity);
    }
}

#[test]
fn a_chunked_prompt_is_cached_whole_when_its_last_chunk_commits() {
    for page in [1, 16] {
        let a = prompt(10);
        let shared = aligned(a.len(), page);
        let mut h = Harness::new(SchedulerConfig {
            chunked_prefill_size: Some(32),
            ..config(page)
        });
        h.add(1, &a, 10);
        let mut chunks = 0;
        loop {
            let plan = h.launch();
            h.land();
            chunks += 1;
            if plan.sample[0] {
                break;
            }
        }
        assert_eq!(chunks, 3);
        assert_eq!(h.s.stats().protected, shared);
        let mut b = a.clone();
        b.push(1);
        h.add(2, &b, 3);
        let plan = h.launch();
        assert_eq!(plan.prefix_lens[position(&plan, 2)] as usize, shared);
        h.run(true);
        h.assert_outputs_undisturbed();
    }
}

#[test]
fn priority_preemption_of_a_cached_request_keeps_the_tree_consistent() {
    let mut h = Harness::new(SchedulerConfig {
        max_total_tokens: 256,
        policy: Policy::Priority,
        ..config(16)
    });
    let a = prompt(11);
    h.add_with(1, &a, 60, 0);
    h.launch();
    h.land();
    assert_eq!(h.s.stats().protected, 64);
    h.add_with(2, &prompt(12), 60, 20);
    let plan = h.launch();
    assert_eq!(plan.retracted, vec![1]);
    h.run(true);
    h.assert_outputs_undisturbed();
    assert_eq!(h.outputs[&1].len(), 60);
}

impl Harness {
    /// The overlap loop as the engine runs it: one step in flight, except that a step whose
    /// commit moves rows (`commit_moves_rows`) commits before the next plan is made. After
    /// every commit, no request of the step still in flight may have rows left to rewrite:
    /// that step would have read slots the commit just replaced. Returns how many steps
    /// the loop committed early.
    fn run_like_the_loop(&mut self, commit_first: bool) -> usize {
        let mut early = 0;
        let mut guard = 0;
        while self.s.has_work() || !self.inflight.is_empty() {
            if commit_first && !self.inflight.is_empty() && self.s.commit_moves_rows() {
                self.land();
                early += 1;
                continue;
            }
            let plan = self.launch();
            let keep = usize::from(plan.mode != ForwardMode::Idle);
            while self.inflight.len() > keep {
                self.land();
                let Some((newest, _)) = self.inflight.back() else {
                    break;
                };
                for &rid in &newest.rids {
                    let req = self.s.request(rid as u64).expect("in flight, so live");
                    assert_eq!(
                        req.stale_row, None,
                        "request {rid}: plan {} read its row before a commit changed it",
                        newest.id
                    );
                }
            }
            guard += 1;
            assert!(guard < 10_000, "no progress: {:?}", self.s.stats());
        }
        early
    }
}

/// A prompt the tree holds whole (a repeat of a finished request's) is matched but for its
/// last token, which the extend computes again for its logits; its commit swaps that
/// token's new KV for the tree's copy. The overlap loop must not plan the request's first
/// decode before that commit, or that decode reads the new copy and every later one the
/// tree's: other bits than without overlap, and with int8 activations other tokens.
#[test]
fn the_overlap_loop_commits_first_where_a_commit_swaps_a_cached_prompts_kv() {
    for page in [1, 16] {
        let a = prompt(13);
        let mut h = Harness::new(config(page));
        h.add(1, &a, 4);
        h.run(true);
        // The tree holds all of A only when its length is whole pages; with pages of 16
        // (70 tokens) the match (64) is everything a commit could cache.
        let swaps = aligned(a.len(), page) > aligned(a.len() - 1, page);
        h.add(2, &a, 4);
        h.launch();
        assert_eq!(h.s.commit_moves_rows(), swaps, "page {page}");
        h.land();
        assert!(!h.s.commit_moves_rows());
        h.run(true);

        // A prompt that another request's in-flight prefill caches: 4 is planned while 3's
        // prefill of the same prompt is in flight, so it matches nothing; 3's commit caches
        // the prompt before 4's commits. Known before either commits.
        let b = prompt(14);
        h.add(3, &b, 4);
        h.launch();
        assert!(!h.s.commit_moves_rows());
        h.add(4, &b, 4);
        assert_eq!(h.launch().rids, vec![4]);
        assert!(
            h.s.commit_moves_rows(),
            "page {page}: 3's prefill in flight"
        );
        h.land();
        assert!(h.s.commit_moves_rows(), "page {page}: 3's prefill cached");
        h.run(true);
        h.assert_outputs_undisturbed();

        // Every case through the loop (3 and 4 are prefilled in one step), checked after
        // every commit; and without committing first, the check catches the stale read (so
        // it is not vacuous).
        for commit_first in [true, false] {
            let mut h = Harness::new(config(page));
            h.add(1, &a, 4);
            h.run(true);
            h.add(2, &a, 6);
            h.add(3, &b, 6);
            h.add(4, &b, 6);
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                h.run_like_the_loop(commit_first)
            }));
            match caught {
                Ok(early) => {
                    assert!(commit_first, "page {page}: the stale read went unnoticed");
                    assert!(early >= 1, "page {page}");
                    h.assert_outputs_undisturbed();
                }
                Err(_) => assert!(!commit_first, "page {page}: a stale read with the fix"),
            }
        }
    }
}
