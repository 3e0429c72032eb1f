//! Commit and the ends of a request: sampled tokens applied, finish checks, stop strings
//! Python found, aborts and failures, and releasing what a finished request held.

use super::*;

impl Scheduler {
    /// Applies a step's sampled tokens (one per request of the plan, in plan order; values for
    /// requests whose `sample` flag is false are ignored). Plans commit in the order planned.
    pub fn commit(&mut self, plan_id: u64, next_token_ids: &[i64]) -> Result<Outcome, CoreError> {
        let front = self.inflight.front().ok_or_else(|| {
            CoreError::Protocol(format!(
                "commit of plan {plan_id}, but no plan is in flight"
            ))
        })?;
        if front.id != plan_id {
            return Err(CoreError::Protocol(format!(
                "commit of plan {plan_id}, but plan {} is the oldest in flight (commit in order)",
                front.id
            )));
        }
        if front.entries.len() != next_token_ids.len() {
            return Err(CoreError::Protocol(format!(
                "plan {plan_id} has {} requests but {} next tokens were given",
                front.entries.len(),
                next_token_ids.len()
            )));
        }
        if let Some(bad) = front
            .entries
            .iter()
            .zip(next_token_ids)
            .find(|(e, &t)| e.sample && !(0..=u32::MAX as i64).contains(&t))
        {
            return Err(CoreError::Protocol(format!(
                "invalid token id {} in commit",
                bad.1
            )));
        }
        let flight = self.inflight.pop_front().expect("checked above");
        let mut out = Outcome {
            finished: std::mem::take(&mut self.pending_reports),
            ..Outcome::default()
        };
        for (e, &token) in flight.entries.iter().zip(next_token_ids) {
            let req = self.reqs[e.idx]
                .as_mut()
                .expect("in-flight requests stay live");
            req.inflight_steps -= 1;
            // A retracted request's stale value is harmless: it is readmitted only once no
            // step of it is in flight, and readmission restarts `computed_len`.
            req.computed_len = req.computed_len.max(e.kv_end);
            if !e.sample {
                continue;
            }
            req.pending_tokens -= 1;
            if req.finish.is_some() {
                continue; // finished or aborted while this step was in flight: drop the token
            }
            req.output.push(token as u32);
            out.rids.push(req.rid as i64);
            out.tokens.push(token);
            self.counters.generated_tokens += 1;
            if let Some(reason) = req.check_finished(&self.cfg.eos_token_ids) {
                out.finished.push(self.mark_finished(e.idx, reason));
            } else if e.completes_prefill && req.state == ReqState::Running && req.cacheable {
                // SGLang's `process_batch_result_prefill`, in batch order: a prompt whose
                // prefill completed goes into the tree now, so that requests arriving while
                // this one decodes share it. (A request retracted since this step was planned
                // holds no KV: it is skipped, as in SGLang.)
                self.cache_unfinished(e.idx, e.kv_end);
            }
        }
        for e in &flight.entries {
            let Some(req) = self.reqs[e.idx].as_mut() else {
                continue;
            };
            if req.inflight_steps > 0 {
                continue;
            }
            if req.finish.is_some() {
                self.release(e.idx);
            } else if req.state == ReqState::Retracted {
                // Retracted while this step was in flight: its request slot is free only now.
                if let Some(slot) = req.req_slot.take() {
                    self.req_slots.free(slot);
                }
            }
        }
        Ok(out)
    }

    pub(super) fn report(&self, req: &Request) -> Finished {
        Finished {
            rid: req.rid,
            reason: req.finish.clone().expect("finished"),
            prompt_tokens: req.prompt.len(),
            completion_tokens: req.output.len(),
            cached_tokens: req.cached_tokens,
        }
    }

    /// Marks a request finished and takes it out of the queues; releases it now unless an
    /// in-flight step still reads its slots. Returns its report.
    pub(super) fn mark_finished(&mut self, idx: usize, reason: FinishReason) -> Finished {
        if matches!(reason, FinishReason::Abort(_)) {
            self.counters.aborts += 1;
        }
        self.counters.finished += 1;
        let req = self.req_mut(idx);
        let state = req.state;
        req.finish = Some(reason);
        req.state = ReqState::Finished;
        let inflight = req.inflight_steps;
        match state {
            ReqState::Running => self.running.retain(|&i| i != idx),
            ReqState::Waiting | ReqState::Retracted => self.waiting.retain(|&i| i != idx),
            ReqState::Chunked => self.chunked = None,
            ReqState::Finished => unreachable!("finished twice"),
        }
        let report = self.report(self.req(idx));
        if inflight == 0 {
            self.release(idx);
        }
        report
    }

    /// Releases a finished request: caches its KV in the tree, frees the rest, forgets it.
    pub(super) fn release(&mut self, idx: usize) {
        let cache = self.req(idx).cacheable;
        self.release_memory(idx, cache);
        let req = self.reqs[idx].take().expect("live request");
        self.by_rid.remove(&req.rid);
        self.free_entries.push(idx);
    }

    /// Finishes a request whose stop string Python found. Returns false for an unknown or
    /// already finished request.
    pub fn finish(&mut self, rid: Rid, matched: String) -> bool {
        match self.by_rid.get(&rid) {
            Some(&idx) if self.req(idx).finish.is_none() => {
                self.mark_finished(idx, FinishReason::StopString(matched));
                true
            }
            _ => false,
        }
    }

    /// Aborts a request: a waiting one leaves at once; one an in-flight step still reads is
    /// released (and reported) by the commit that completes that step.
    pub fn abort(&mut self, rid: Rid, message: String) -> AbortStatus {
        let Some(&idx) = self.by_rid.get(&rid) else {
            return AbortStatus::Unknown;
        };
        if self.req(idx).finish.is_some() {
            return AbortStatus::Unknown;
        }
        let deferred = self.req(idx).inflight_steps > 0;
        let report = self.mark_finished(idx, FinishReason::Abort(message));
        if deferred {
            self.pending_reports.push(report);
            AbortStatus::Deferred
        } else {
            AbortStatus::Removed
        }
    }

    /// Aborts a request that was in a step whose execution failed. As `abort`, except that
    /// none of its KV is inserted into the prefix tree from now on: the failed step may have
    /// written some of it, or none, so other requests must not reuse it. What committed steps
    /// computed and already put there (its prompt once its prefill step committed, committed
    /// chunks) stays: the failed step only wrote its own new slots. Idempotent; a request
    /// that already finished but is still held by an in-flight step loses its caching too.
    pub fn fail(&mut self, rid: Rid, message: String) -> AbortStatus {
        let Some(&idx) = self.by_rid.get(&rid) else {
            return AbortStatus::Unknown;
        };
        self.req_mut(idx).cacheable = false;
        self.abort(rid, message)
    }

    /// Empties the prefix cache. Only when nothing is queued, running or in flight.
    pub fn flush_cache(&mut self) -> bool {
        if self.live_requests() > 0 || !self.inflight.is_empty() {
            return false;
        }
        self.scratch.clear();
        self.tree.reset(&mut self.scratch);
        self.pool.free_run(&self.scratch);
        true
    }
}
