//! `Scheduler`, its options (`default_config`) and its per-call conversions.

use super::*;

/// A `SchedulerConfig` as the keyword arguments of `Scheduler(...)` (chunking off: -1).
pub(super) fn config_to_py<'py>(
    py: Python<'py>,
    c: &SchedulerConfig,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("max_total_tokens", c.max_total_tokens)?;
    d.set_item("page_size", c.page_size)?;
    d.set_item("max_running_requests", c.max_running_requests)?;
    d.set_item("context_len", c.context_len)?;
    d.set_item("max_prefill_tokens", c.max_prefill_tokens)?;
    let chunk = c.chunked_prefill_size.map_or(-1, |n| n as i64);
    d.set_item("chunked_prefill_size", chunk)?;
    d.set_item("schedule_policy", c.policy.name())?;
    d.set_item("schedule_conservativeness", c.schedule_conservativeness)?;
    d.set_item("disable_radix_cache", c.disable_radix_cache)?;
    d.set_item("enable_mixed_chunk", c.enable_mixed_chunk)?;
    d.set_item(
        "priority_preemption_threshold",
        c.priority_preemption_threshold,
    )?;
    d.set_item("low_priority_values_first", c.low_priority_values_first)?;
    d.set_item("eos_token_ids", c.eos_token_ids.clone())?;
    d.set_item("seed", c.seed)?;
    d.set_item("spec_num_draft_tokens", c.spec_num_draft_tokens)?;
    d.set_item("spec_ngram_min_window", c.spec_ngram_min_window)?;
    d.set_item("spec_ngram_max_window", c.spec_ngram_max_window)?;
    d.set_item("spec_draft_model", c.spec_draft_model)?;
    Ok(d)
}

/// `SchedulerConfig::default()`: what `Scheduler()` runs with for each option not given.
/// The Python defaults (`rsgl.args.EngineArgs`) are tested against it.
#[pyfunction]
pub(super) fn default_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    config_to_py(py, &SchedulerConfig::default())
}

/// The scheduling core: one instance per model replica.
#[pyclass(module = "rsgl._core", name = "Scheduler")]
pub struct PyScheduler {
    pub(super) inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    /// Every option is optional: what is not given keeps `SchedulerConfig::default()`
    /// (`default_config()` lists those). `chunked_prefill_size` <= 0 disables chunking.
    #[new]
    #[pyo3(signature = (
        max_total_tokens=None, *, page_size=None, max_running_requests=None, context_len=None,
        max_prefill_tokens=None, chunked_prefill_size=None, schedule_policy=None,
        schedule_conservativeness=None, disable_radix_cache=None, enable_mixed_chunk=None,
        priority_preemption_threshold=None, low_priority_values_first=None,
        eos_token_ids=None, seed=None, spec_num_draft_tokens=None, spec_ngram_min_window=None,
        spec_ngram_max_window=None, spec_draft_model=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_total_tokens: Option<usize>,
        page_size: Option<usize>,
        max_running_requests: Option<usize>,
        context_len: Option<usize>,
        max_prefill_tokens: Option<usize>,
        chunked_prefill_size: Option<i64>,
        schedule_policy: Option<&str>,
        schedule_conservativeness: Option<f64>,
        disable_radix_cache: Option<bool>,
        enable_mixed_chunk: Option<bool>,
        priority_preemption_threshold: Option<i64>,
        low_priority_values_first: Option<bool>,
        eos_token_ids: Option<Vec<u32>>,
        seed: Option<u64>,
        spec_num_draft_tokens: Option<usize>,
        spec_ngram_min_window: Option<usize>,
        spec_ngram_max_window: Option<usize>,
        spec_draft_model: Option<bool>,
    ) -> PyResult<Self> {
        let d = SchedulerConfig::default();
        let policy = match schedule_policy {
            Some(name) => name.parse().map_err(PyValueError::new_err)?,
            None => d.policy,
        };
        let cfg = SchedulerConfig {
            max_total_tokens: max_total_tokens.unwrap_or(d.max_total_tokens),
            page_size: page_size.unwrap_or(d.page_size),
            max_running_requests: max_running_requests.unwrap_or(d.max_running_requests),
            context_len: context_len.unwrap_or(d.context_len),
            max_prefill_tokens: max_prefill_tokens.unwrap_or(d.max_prefill_tokens),
            // SGLang: -1 (or any value <= 0) disables chunked prefill.
            chunked_prefill_size: match chunked_prefill_size {
                Some(c) => usize::try_from(c).ok().filter(|&c| c > 0),
                None => d.chunked_prefill_size,
            },
            policy,
            schedule_conservativeness: schedule_conservativeness
                .unwrap_or(d.schedule_conservativeness),
            disable_radix_cache: disable_radix_cache.unwrap_or(d.disable_radix_cache),
            enable_mixed_chunk: enable_mixed_chunk.unwrap_or(d.enable_mixed_chunk),
            priority_preemption_threshold: priority_preemption_threshold
                .unwrap_or(d.priority_preemption_threshold),
            low_priority_values_first: low_priority_values_first
                .unwrap_or(d.low_priority_values_first),
            eos_token_ids: eos_token_ids.unwrap_or(d.eos_token_ids),
            seed: seed.unwrap_or(d.seed),
            spec_num_draft_tokens: spec_num_draft_tokens.unwrap_or(d.spec_num_draft_tokens),
            spec_ngram_min_window: spec_ngram_min_window.unwrap_or(d.spec_ngram_min_window),
            spec_ngram_max_window: spec_ngram_max_window.unwrap_or(d.spec_ngram_max_window),
            spec_draft_model: spec_draft_model.unwrap_or(d.spec_draft_model),
        };
        Ok(Self {
            inner: Scheduler::new(cfg).map_err(to_py_err)?,
        })
    }

    /// The options this core runs with, named as the constructor's keywords.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_to_py(py, self.inner.config())
    }

    /// Queues a request; raises ValueError (nothing queued) for a prompt that can never run.
    #[pyo3(signature = (
        rid, input_ids, max_new_tokens=128, *, min_new_tokens=0, stop_token_ids=Vec::new(),
        ignore_eos=false, priority=0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        rid: u64,
        input_ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        min_new_tokens: i64,
        stop_token_ids: Vec<u32>,
        ignore_eos: bool,
        priority: i64,
    ) -> PyResult<()> {
        if max_new_tokens < 1 {
            return Err(PyValueError::new_err(format!(
                "max_new_tokens must be at least 1, got {max_new_tokens}"
            )));
        }
        if min_new_tokens < 0 {
            return Err(PyValueError::new_err(format!(
                "min_new_tokens must be non-negative, got {min_new_tokens}"
            )));
        }
        let prompt = extract_tokens(input_ids, "input_ids")?;
        let limits = SamplingLimits {
            max_new_tokens: max_new_tokens as usize,
            min_new_tokens: min_new_tokens as usize,
            stop_token_ids,
            ignore_eos,
            priority,
        };
        self.inner
            .add_request(rid, prompt, limits)
            .map_err(to_py_err)
    }

    /// Plans the next step.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyPlan> {
        Ok(plan_to_py(py, self.inner.schedule()))
    }

    /// Up to `max_steps` times, as the overlap loop when its oldest step ends: commits the
    /// oldest plan in flight with `token` for every request, then plans the next step
    /// (`rsgl bench simulate`'s runs of plain decode steps). Returns `(committed,
    /// tokens_per_step, rids, finished, plan_ids, batch_sizes, context_tokens, other)`: the
    /// steps committed, how many requests each gave a token and their ids (step after
    /// step), `(step, Finished)` for what they finished, each plain decode plan made (id,
    /// batch size, KV read), and the plan that ended the run by not being one (or None).
    fn decode_run(&mut self, py: Python<'_>, max_steps: usize, token: i64) -> PyResult<Py<PyAny>> {
        let run = self.inner.decode_run(max_steps, token).map_err(to_py_err)?;
        let finished = run
            .finished
            .into_iter()
            .map(|(step, f)| Ok((step, finished_list(py, vec![f])?.remove(0))))
            .collect::<PyResult<Vec<_>>>()?;
        let plan_ids: Vec<i64> = run.plan_ids.into_iter().map(|id| id as i64).collect();
        let other = run.other.map(|p| plan_to_py(py, p));
        let out = (
            run.committed,
            array(py, run.tokens_per_step),
            array(py, run.rids),
            finished,
            array(py, plan_ids),
            array(py, run.batch_sizes),
            array(py, run.context_tokens),
            other,
        );
        Ok(out.into_pyobject(py)?.into_any().unbind())
    }

    /// Applies a step's sampled tokens (one per request of the plan, in plan order).
    fn commit(
        &mut self,
        py: Python<'_>,
        plan_id: u64,
        next_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<PyOutcome> {
        let tokens = extract_i64(next_token_ids, "next_token_ids")?;
        let out = self.inner.commit(plan_id, &tokens).map_err(to_py_err)?;
        outcome_to_py(py, out)
    }

    /// Applies a speculative step's accepted tokens: per request in plan order,
    /// `accept_lens[i]` tokens (accepted drafts, then the bonus token) laid out one request
    /// after another in `tokens`; `1 <= accept_lens[i] <= 1 + plan.draft_lens[i]`, exactly 1
    /// where `sample` is false. Tokens after a finish are dropped. The outcome lists every
    /// committed token, a request's tokens consecutively and in order.
    fn commit_spec(
        &mut self,
        py: Python<'_>,
        plan_id: u64,
        tokens: &Bound<'_, PyAny>,
        accept_lens: &Bound<'_, PyAny>,
    ) -> PyResult<PyOutcome> {
        let tokens = extract_i64(tokens, "tokens")?;
        let accept_lens = extract_i64(accept_lens, "accept_lens")?;
        let out = self
            .inner
            .commit_spec(plan_id, &tokens, &accept_lens)
            .map_err(to_py_err)?;
        outcome_to_py(py, out)
    }

    /// Caps the drafts per request of the steps planned from now on (0: no speculation).
    fn set_draft_limit(&mut self, limit: usize) {
        self.inner.set_draft_limit(limit);
    }

    /// The drafts per request a step may carry now (configured and `set_draft_limit`).
    #[getter]
    fn draft_limit(&self) -> usize {
        self.inner.draft_limit()
    }

    /// How many would-be verifies of the steps planned with a draft limit of 0 accepted
    /// each number of drafts (index 0: none) since the last call; zeroed by the call.
    fn take_shadow_accepts(&mut self) -> Vec<u64> {
        self.inner.take_shadow_accepts()
    }

    /// Stops a request from speculating; false when there is no such live request.
    fn disable_speculation(&mut self, rid: u64) -> bool {
        self.inner.disable_speculation(rid)
    }

    /// Aborts a request: returns "removed" (released now), "deferred" (a later commit reports
    /// it) or "unknown".
    #[pyo3(signature = (rid, message="aborted by the client".to_string()))]
    fn abort(&mut self, rid: u64, message: String) -> &'static str {
        match self.inner.abort(rid, message) {
            AbortStatus::Removed => "removed",
            AbortStatus::Deferred => "deferred",
            AbortStatus::Unknown => "unknown",
        }
    }

    /// Aborts a request that was in a failed step, as `abort`, but none of its KV is cached
    /// from now on (the failed step may have written part of it); what committed steps
    /// computed and already shared stays. Same return values as `abort`.
    fn fail(&mut self, rid: u64, message: String) -> &'static str {
        match self.inner.fail(rid, message) {
            AbortStatus::Removed => "removed",
            AbortStatus::Deferred => "deferred",
            AbortStatus::Unknown => "unknown",
        }
    }

    /// Finishes a request whose stop string Python found; false if unknown or finished.
    fn finish(&mut self, rid: u64, matched: String) -> bool {
        self.inner.finish(rid, matched)
    }

    /// Empties the prefix cache; only possible when nothing is queued, running or in flight.
    fn flush_cache(&mut self) -> bool {
        self.inner.flush_cache()
    }

    /// Raises RuntimeError describing the first broken invariant, if any.
    fn check(&self) -> PyResult<()> {
        self.inner
            .check()
            .map_err(|m| PyRuntimeError::new_err(format!("integrity check failed: {m}")))
    }

    /// Whether committing the steps in flight would swap slots in some request's row (a
    /// prefill over a prompt the tree holds): the overlap loop commits before planning then.
    #[getter]
    fn commit_moves_rows(&self) -> bool {
        self.inner.commit_moves_rows()
    }

    /// Whether anything is queued, running or in flight.
    #[getter]
    fn has_work(&self) -> bool {
        self.inner.has_work()
    }

    /// Rows the executor's K/V buffers need (slots `0..page_size` are padding).
    #[getter]
    fn kv_buffer_size(&self) -> usize {
        self.inner.kv_buffer_size()
    }

    /// Tokens per KV page (slots `0..page_size` are padding).
    #[getter]
    fn page_size(&self) -> usize {
        self.inner.config().page_size
    }

    /// Longest prompt that leaves room for one output token.
    #[getter]
    fn max_prompt_len(&self) -> usize {
        self.inner.max_prompt_len()
    }

    /// Output tokens a prompt of this length leaves room for (0: it would be rejected).
    fn max_new_tokens_room(&self, prompt_len: usize) -> usize {
        self.inner.max_new_tokens_room(prompt_len)
    }

    /// Load and counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let c = &s.counters;
        let d = PyDict::new(py);
        let items: [(&str, f64); 25] = [
            ("waiting", s.waiting as f64),
            ("running", s.running as f64),
            ("chunked", s.chunked as f64),
            ("live", s.live as f64),
            ("inflight_plans", s.inflight_plans as f64),
            ("capacity", s.capacity as f64),
            ("available", s.available as f64),
            ("evictable", s.evictable as f64),
            ("protected", s.protected as f64),
            ("held", s.held as f64),
            ("free_req_slots", s.free_req_slots as f64),
            ("new_token_ratio", s.new_token_ratio),
            ("requests", c.requests as f64),
            ("prompt_tokens", c.prompt_tokens as f64),
            ("cached_tokens", c.cached_tokens as f64),
            ("generated_tokens", c.generated_tokens as f64),
            ("retractions", c.retractions as f64),
            ("preemptions", c.preemptions as f64),
            ("aborts", c.aborts as f64),
            ("finished", c.finished as f64),
            ("extend_steps", c.extend_steps as f64),
            ("decode_steps", c.decode_steps as f64),
            ("mixed_steps", c.mixed_steps as f64),
            ("draft_tokens", c.draft_tokens as f64),
            ("accepted_draft_tokens", c.accepted_draft_tokens as f64),
        ];
        for (k, v) in items {
            if k == "new_token_ratio" {
                d.set_item(k, v)?;
            } else {
                d.set_item(k, v as u64)?;
            }
        }
        Ok(d)
    }

    /// A live request's state (for tests and debugging), or None.
    fn request_info<'py>(&self, py: Python<'py>, rid: u64) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(r) = self.inner.request(rid) else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("state", format!("{:?}", r.state).to_lowercase())?;
        d.set_item("output_ids", r.output.clone())?;
        d.set_item("prompt_len", r.prompt.len())?;
        d.set_item("max_new_tokens", r.limits.max_new_tokens)?;
        d.set_item("kv_len", r.kv_len())?;
        d.set_item("prefix_len", r.prefix_len)?;
        d.set_item("req_slot", r.req_slot)?;
        d.set_item("cached_tokens", r.cached_tokens)?;
        Ok(Some(d))
    }
}

/// A core outcome as the Python `Outcome`.
fn outcome_to_py(py: Python<'_>, out: crate::Outcome) -> PyResult<PyOutcome> {
    Ok(PyOutcome {
        rids: array(py, out.rids),
        tokens: array(py, out.tokens),
        finished: finished_list(py, out.finished)?,
    })
}

/// A core plan as the Python `Plan` (its vectors become numpy arrays, without copies).
fn plan_to_py(py: Python<'_>, p: Plan) -> PyPlan {
    PyPlan {
        id: p.id,
        forward_mode: p.mode.name(),
        batch_size: p.rids.len(),
        num_extends: p.num_extends,
        num_tokens: p.input_ids.len(),
        rids: array(py, p.rids),
        req_slots: array(py, p.req_slots),
        prefix_lens: array(py, p.prefix_lens),
        extend_lens: array(py, p.extend_lens),
        seq_lens: array(py, p.seq_lens),
        draft_lens: array(py, p.draft_lens),
        sample: PyArray1::from_vec(py, p.sample).unbind(),
        input_ids: array(py, p.input_ids),
        positions: array(py, p.positions),
        out_cache_loc: array(py, p.out_cache_loc),
        write_rows: array(py, p.write_rows),
        write_cols: array(py, p.write_cols),
        write_slots: array(py, p.write_slots),
        admitted: array(py, p.admitted),
        retracted: array(py, p.retracted),
    }
}
