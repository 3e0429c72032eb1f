//! Runs of plain decode steps without a round trip per step, for the capacity simulator
//! (`rsgl bench simulate`): the same commit-then-plan calls the overlap loop makes each time
//! its oldest step ends, so the plans are the ones that loop would get.

use super::*;

/// What `Scheduler::decode_run` did.
#[derive(Debug, Default)]
pub struct DecodeRun {
    /// Steps committed.
    pub committed: usize,
    /// Per committed step, how many requests received a token.
    pub tokens_per_step: Vec<i64>,
    /// The requests that received a token, step after step.
    pub rids: Vec<i64>,
    /// The requests each committed step finished, with the step's index in the run.
    pub finished: Vec<(usize, Finished)>,
    /// Per plain decode plan made after a commit: its id, batch size and the KV it reads
    /// (the sum of its sequence lengths).
    pub plan_ids: Vec<u64>,
    /// See `plan_ids`.
    pub batch_sizes: Vec<i64>,
    /// See `plan_ids`.
    pub context_tokens: Vec<i64>,
    /// The plan that ended the run because it is not a plain decode (an extend, a
    /// retraction, an idle plan): the caller takes over with it.
    pub other: Option<Plan>,
}

impl Scheduler {
    /// Up to `max_steps` times: commits the oldest plan in flight with `token` for every
    /// request, then plans the next step. Stops after planning a step that is not a plain
    /// decode (returned in `other`), when nothing is in flight, or after a commit that leaves
    /// requests waiting or a chunked prefill (the caller plans next).
    pub fn decode_run(&mut self, max_steps: usize, token: i64) -> Result<DecodeRun, CoreError> {
        let mut run = DecodeRun::default();
        let mut tokens = Vec::new();
        while run.committed < max_steps {
            let Some(front) = self.inflight.front() else {
                break;
            };
            let id = front.id;
            tokens.clear();
            tokens.resize(front.entries.len(), token);
            let out = self.commit(id, &tokens)?;
            run.tokens_per_step.push(out.rids.len() as i64);
            run.rids.extend_from_slice(&out.rids);
            let step = run.committed;
            run.finished
                .extend(out.finished.into_iter().map(|f| (step, f)));
            run.committed += 1;
            if !self.waiting.is_empty() || self.chunked.is_some() {
                break;
            }
            let plan = self.schedule();
            let plain = plan.mode == ForwardMode::Decode
                && plan.retracted.is_empty()
                && plan.admitted.is_empty();
            if !plain {
                run.other = Some(plan);
                break;
            }
            run.plan_ids.push(plan.id);
            run.batch_sizes.push(plan.rids.len() as i64);
            run.context_tokens.push(plan.seq_lens.iter().sum());
        }
        Ok(run)
    }
}
