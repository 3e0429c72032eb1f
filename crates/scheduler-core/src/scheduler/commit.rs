//! Commit and the ends of a request: sampled tokens applied, finish checks, stop strings
//! Python found, aborts and failures, and releasing what a finished request held.

use super::*;

impl Scheduler {
    /// Applies a step's sampled tokens (one per request of the plan, in plan order; values for
    /// requests whose `sample` flag is false are ignored). Plans commit in the order planned.
    /// Drafts of a speculative step are all rejected: [`commit_spec`](Self::commit_spec) with
    /// every accept length 1.
    pub fn commit(&mut self, plan_id: u64, next_token_ids: &[i64]) -> Result<Outcome, CoreError> {
        self.commit_accepted(plan_id, next_token_ids, None)
    }

    /// Applies a speculative step's accepted tokens. `tokens` holds, per request in plan order,
    /// `accept_lens[i]` tokens: the accepted drafts then the bonus token, so
    /// `1 <= accept_lens[i] <= 1 + draft_lens[i]` (exactly 1, ignored, where `sample` is
    /// false). They are appended one at a time, each checked for a finish; what follows a
    /// finish is dropped. The KV of the rejected positions is given back.
    pub fn commit_spec(
        &mut self,
        plan_id: u64,
        tokens: &[i64],
        accept_lens: &[i64],
    ) -> Result<Outcome, CoreError> {
        self.commit_accepted(plan_id, tokens, Some(accept_lens))
    }

    /// Checks a commit's arguments against the oldest plan in flight.
    fn check_commit(
        &self,
        plan_id: u64,
        tokens: &[i64],
        accept_lens: Option<&[i64]>,
    ) -> Result<(), CoreError> {
        let protocol = |m: String| Err(CoreError::Protocol(m));
        let Some(front) = self.inflight.front() else {
            return protocol(format!(
                "commit of plan {plan_id}, but no plan is in flight"
            ));
        };
        if front.id != plan_id {
            return protocol(format!(
                "commit of plan {plan_id}, but plan {} is the oldest in flight (commit in order)",
                front.id
            ));
        }
        let n = front.entries.len();
        let lens_ok = accept_lens.is_none_or(|l| l.len() == n);
        let expected = match accept_lens {
            Some(l) if lens_ok => l
                .iter()
                .fold(0usize, |sum, &a| sum.saturating_add(a.max(0) as usize)),
            _ => n,
        };
        if !lens_ok {
            return protocol(format!(
                "plan {plan_id} has {n} requests but {} accept lengths were given",
                accept_lens.map_or(n, <[i64]>::len)
            ));
        }
        if tokens.len() != expected {
            return protocol(format!(
                "plan {plan_id} has {n} requests but {} next tokens were given ({expected} \
                 expected)",
                tokens.len()
            ));
        }
        let mut offset = 0;
        for (i, e) in front.entries.iter().enumerate() {
            let a = accept_lens.map_or(1, |l| l[i]);
            let max = if e.sample { 1 + e.draft_len as i64 } else { 1 };
            if !(1..=max).contains(&a) {
                return protocol(format!(
                    "accept length {a} of request {i} of plan {plan_id}: it must be 1 to {max}"
                ));
            }
            let run = &tokens[offset..offset + a as usize];
            offset += a as usize;
            if let Some(bad) = run
                .iter()
                .find(|&&t| e.sample && !(0..=u32::MAX as i64).contains(&t))
            {
                return protocol(format!("invalid token id {bad} in commit"));
            }
        }
        Ok(())
    }

    /// `commit` and `commit_spec`: `accept_lens` of `None` means 1 for every request.
    fn commit_accepted(
        &mut self,
        plan_id: u64,
        tokens: &[i64],
        accept_lens: Option<&[i64]>,
    ) -> Result<Outcome, CoreError> {
        self.check_commit(plan_id, tokens, accept_lens)?;
        let flight = self.inflight.pop_front().expect("checked above");
        let mut out = Outcome {
            finished: std::mem::take(&mut self.pending_reports),
            ..Outcome::default()
        };
        let mut offset = 0;
        for (i, e) in flight.entries.iter().enumerate() {
            let a = accept_lens.map_or(1, |l| l[i] as usize);
            let run = &tokens[offset..offset + a];
            offset += a;
            self.commit_entry(e, run, flight.shadow, &mut out);
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

    /// Commits one request's accepted `run` of tokens from one step (`shadow`: the step's
    /// plain tokens check shadow drafts).
    fn commit_entry(&mut self, e: &Entry, run: &[i64], shadow: bool, out: &mut Outcome) {
        let req = self.reqs[e.idx]
            .as_mut()
            .expect("in-flight requests stay live");
        req.inflight_steps -= 1;
        req.drafts_in_flight = 0;
        // KV positions of this step that stay valid: the first input is always committed; a
        // draft's only once every token up to it is.
        let mut kept = 1;
        let mut finish = None;
        if e.sample {
            req.pending_tokens -= 1 + e.draft_len;
            // A finished or aborted request (while this step was in flight) drops its tokens.
            if req.finish.is_none() {
                let mut appended = 0;
                for &token in run {
                    req.output.push(token as u32);
                    out.rids.push(req.rid as i64);
                    out.tokens.push(token);
                    appended += 1;
                    finish = req.check_finished(&self.cfg.eos_token_ids);
                    if finish.is_some() {
                        break;
                    }
                }
                kept = run.len().min(appended + 1);
                self.counters.generated_tokens += appended as u64;
                self.counters.accepted_draft_tokens += run.len() as u64 - 1;
                if e.draft_len > 0 {
                    req.verified(e.draft_len, run.len() - 1);
                }
            }
            if !shadow {
                req.shadow = None; // a verify step: its shadow no longer follows it
            } else if req.finish.is_none() {
                let token = req.output[req.output.len() - 1];
                self.check_shadow(e.idx, token, finish.is_some());
            }
        }
        if e.draft_len > 0 {
            self.drop_rejected_kv(e.idx, e.kv_end, e.draft_len, kept);
        }
        let kv_end = e.kv_end - (1 + e.draft_len - kept);
        let req = self.req_mut(e.idx);
        // A retracted request's stale value is harmless: it is readmitted only once no
        // step of it is in flight, and readmission restarts `computed_len`.
        req.computed_len = req.computed_len.max(kv_end);
        if let Some(reason) = finish {
            out.finished.push(self.mark_finished(e.idx, reason));
        } else if e.completes_prefill && req.state == ReqState::Running && req.cacheable {
            // SGLang's `process_batch_result_prefill`, in batch order: a prompt whose
            // prefill completed goes into the tree now, so that requests arriving while
            // this one decodes share it. (A request retracted since this step was planned
            // holds no KV: it is skipped, as in SGLang.)
            self.cache_unfinished(e.idx, e.kv_end);
        }
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
