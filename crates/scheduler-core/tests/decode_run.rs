//! `Scheduler::decode_run` (the capacity simulator's runs of decode steps) makes exactly the
//! calls the overlap loop makes when its oldest step ends (commit it, plan the next): the
//! same plans, in the same order, and the same finishes, through retractions.

use std::collections::VecDeque;

use scheduler_core::{ForwardMode, Plan, SamplingLimits, Scheduler, SchedulerConfig};

const TOKEN: i64 = 7;
const REQUESTS: u64 = 40;

/// What a plan is, as far as the order of the run goes.
type Step = (u64, ForwardMode, Vec<i64>, i64);

fn step(p: &Plan) -> Step {
    (p.id, p.mode, p.rids.clone(), p.seq_lens.iter().sum())
}

/// A small pool, long outputs: it retracts.
fn scheduler() -> Scheduler {
    let cfg = SchedulerConfig {
        max_total_tokens: 800,
        max_running_requests: 16,
        context_len: 512,
        chunked_prefill_size: Some(128),
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    for rid in 0..REQUESTS {
        let len = 8 + (rid as usize * 37) % 192;
        let prompt = (0..len)
            .map(|i| 10 + ((rid as usize * 131 + i * 7) % 900) as u32)
            .collect();
        let limits = SamplingLimits {
            max_new_tokens: 32 + (rid as usize * 53) % 128,
            min_new_tokens: 0,
            stop_token_ids: vec![],
            ignore_eos: true,
            priority: 0,
        };
        s.add_request(rid, prompt, limits).unwrap();
    }
    s
}

/// Plans `p` (launched unless idle).
fn launch(p: Plan, steps: &mut Vec<Step>, inflight: &mut VecDeque<(u64, usize)>) {
    steps.push(step(&p));
    if p.mode != ForwardMode::Idle {
        inflight.push_back((p.id, p.rids.len()));
    }
}

/// The overlap loop, call by call: two plans in flight, then commit the oldest and plan.
fn reference() -> (Vec<Step>, Vec<u64>, u64) {
    let mut s = scheduler();
    let (mut steps, mut finished, mut inflight) = (vec![], vec![], VecDeque::new());
    launch(s.schedule(), &mut steps, &mut inflight);
    launch(s.schedule(), &mut steps, &mut inflight);
    while let Some((id, n)) = inflight.pop_front() {
        let out = s.commit(id, &vec![TOKEN; n]).unwrap();
        finished.extend(out.finished.iter().map(|f| f.rid));
        launch(s.schedule(), &mut steps, &mut inflight);
    }
    s.check().unwrap();
    (steps, finished, s.stats().counters.retractions)
}

/// The same with runs of at most `max_steps` commits per `decode_run` call.
fn with_runs(max_steps: usize) -> (Vec<Step>, Vec<u64>, u64) {
    let mut s = scheduler();
    let (mut steps, mut finished, mut inflight) = (vec![], vec![], VecDeque::new());
    launch(s.schedule(), &mut steps, &mut inflight);
    launch(s.schedule(), &mut steps, &mut inflight);
    while !inflight.is_empty() {
        let run = s.decode_run(max_steps, TOKEN).unwrap();
        assert!(run.committed >= 1);
        finished.extend(run.finished.iter().map(|(_, f)| f.rid));
        // The run's own plans are committed by it too once they are the oldest.
        for i in 0..run.plan_ids.len() {
            steps.push((
                run.plan_ids[i],
                ForwardMode::Decode,
                vec![],
                run.context_tokens[i],
            ));
            inflight.push_back((run.plan_ids[i], run.batch_sizes[i] as usize));
        }
        for _ in 0..run.committed {
            inflight.pop_front().unwrap();
        }
        let planned = run.plan_ids.len() + usize::from(run.other.is_some());
        if let Some(p) = run.other {
            launch(p, &mut steps, &mut inflight);
        } else if planned < run.committed {
            launch(s.schedule(), &mut steps, &mut inflight); // it stopped before planning
        }
    }
    s.check().unwrap();
    (steps, finished, s.stats().counters.retractions)
}

#[test]
fn decode_runs_make_the_overlap_loops_plans() {
    let (steps, finished, retractions) = reference();
    assert!(retractions > 0);
    assert_eq!(finished.len(), REQUESTS as usize);
    for max_steps in [1, 3, 1000] {
        let (run_steps, run_finished, run_retractions) = with_runs(max_steps);
        assert_eq!(run_finished, finished);
        assert_eq!(run_retractions, retractions);
        assert_eq!(run_steps.len(), steps.len());
        for (a, b) in run_steps.iter().zip(&steps) {
            // A run reports its plain decode plans by id, mode and KV read, not their rows.
            assert_eq!((a.0, a.1, a.3), (b.0, b.1, b.3));
            if a.1 != ForwardMode::Decode || !a.2.is_empty() {
                assert_eq!(a.2, b.2);
            }
        }
    }
}
