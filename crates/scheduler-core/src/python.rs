//! PyO3 bindings: `rsgl._core`. Converts types and errors; no scheduling logic lives here.
//!
//! Arrays cross as numpy int64 arrays built from the core's vectors without copying
//! (`PyArray1::from_vec` takes ownership of the buffer).

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::pool::TokenPool;
use crate::radix::RadixTree;
use crate::request::{FinishReason, SamplingLimits};
use crate::scheduler::{AbortStatus, CoreError, Finished, Scheduler, SchedulerConfig};

fn to_py_err(e: CoreError) -> PyErr {
    match e {
        CoreError::InvalidRequest(m) => PyValueError::new_err(m),
        CoreError::Protocol(m) => PyRuntimeError::new_err(m),
    }
}

/// Token ids from a numpy integer array or any sequence of ints, checked to fit `u32`.
fn extract_tokens(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
    let check = |v: i64| {
        u32::try_from(v)
            .map_err(|_| PyValueError::new_err(format!("{field}: invalid token id {v}")))
    };
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_array().iter().map(|&v| check(v)).collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return a.as_array().iter().map(|&v| check(v as i64)).collect();
    }
    let values: Vec<i64> = obj
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{field} must be a sequence of token ids")))?;
    values.into_iter().map(check).collect()
}

/// int64 values from a numpy array (zero-copy when contiguous int64) or a sequence.
fn extract_i64(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(a.as_array().to_vec());
    }
    obj.extract()
        .map_err(|_| PyValueError::new_err(format!("{field} must be a sequence of ints")))
}

/// The contents of a contiguous uint32 array.
///
/// Skips numpy's dynamic borrow tracking, which costs more than the tree operations these
/// arrays feed. Sound because the slice does not outlive the call, the GIL is held throughout
/// (no Python code can touch the array meanwhile), and no other borrow of it is taken.
fn readonly<'a>(a: &'a Bound<'_, PyArray1<u32>>) -> PyResult<&'a [u32]> {
    // SAFETY: see above.
    unsafe { a.as_slice() }.map_err(|e| PyValueError::new_err(format!("array: {e}")))
}

/// A writeable view of an `out` array (numpy's borrow tracking rejects read-only arrays).
fn writable<'py>(a: &Bound<'py, PyArray1<u32>>) -> PyResult<PyReadwriteArray1<'py, u32>> {
    a.try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out array: {e}")))
}

fn array<'py>(py: Python<'py>, v: Vec<i64>) -> Py<PyArray1<i64>> {
    PyArray1::from_vec(py, v).unbind()
}

/// Why a request finished, typed: SGLang's `finish_reason` without guessing from a dict.
///
/// `kind` is "stop" (by `matched_token` or `matched_str`), "length" (`length` tokens) or
/// "abort" (`message`, and the HTTP `status_code` the API answers when the server, not the
/// client, ended it). `to_dict()` gives the API's dict and `from_dict` reads it back (for
/// the process boundary).
#[pyclass(
    module = "rsgl._core",
    name = "FinishReason",
    frozen,
    eq,
    hash,
    get_all
)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyFinishReason {
    /// "stop", "length" or "abort".
    kind: &'static str,
    /// The stop or EOS token that ended it.
    matched_token: Option<u32>,
    /// The stop string that ended it.
    matched_str: Option<String>,
    /// The output length that ended it.
    length: Option<usize>,
    /// Why it was aborted.
    message: Option<String>,
    /// The HTTP status of a server-side abort (400, 500, 503, ...); None for a client's.
    status_code: Option<u16>,
}

impl PyFinishReason {
    fn new(kind: &'static str) -> Self {
        PyFinishReason {
            kind,
            matched_token: None,
            matched_str: None,
            length: None,
            message: None,
            status_code: None,
        }
    }
}

impl From<FinishReason> for PyFinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Length(n) => PyFinishReason::max_length(n),
            FinishReason::StopToken(t) => PyFinishReason::stop_token(t),
            FinishReason::StopString(s) => PyFinishReason::stop_str(s),
            FinishReason::Abort(m) => PyFinishReason::abort(m, None),
        }
    }
}

#[pymethods]
impl PyFinishReason {
    /// Stopped by token `token` (EOS or one of the request's stop_token_ids).
    #[staticmethod]
    fn stop_token(token: u32) -> Self {
        PyFinishReason {
            matched_token: Some(token),
            ..Self::new("stop")
        }
    }

    /// Stopped by stop string `matched`.
    #[staticmethod]
    fn stop_str(matched: String) -> Self {
        PyFinishReason {
            matched_str: Some(matched),
            ..Self::new("stop")
        }
    }

    /// Reached its length limit after `length` output tokens.
    #[staticmethod]
    fn max_length(length: usize) -> Self {
        PyFinishReason {
            length: Some(length),
            ..Self::new("length")
        }
    }

    /// Aborted with `message`; `status_code` when the server ended it (an error for the API).
    #[staticmethod]
    #[pyo3(signature = (message, status_code=None))]
    fn abort(message: String, status_code: Option<u16>) -> Self {
        PyFinishReason {
            message: Some(message),
            status_code,
            ..Self::new("abort")
        }
    }

    /// SGLang's dict: `{"type": "stop", "matched": id or str}`, `{"type": "length",
    /// "length": n}` or `{"type": "abort", "message": str[, "status_code": int]}`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("type", self.kind)?;
        if let Some(t) = self.matched_token {
            d.set_item("matched", t)?;
        }
        if let Some(s) = &self.matched_str {
            d.set_item("matched", s)?;
        }
        if let Some(n) = self.length {
            d.set_item("length", n)?;
        }
        if let Some(m) = &self.message {
            d.set_item("message", m)?;
        }
        if let Some(c) = self.status_code {
            d.set_item("status_code", c)?;
        }
        Ok(d)
    }

    /// The inverse of `to_dict`; ValueError for a dict that is not one of its shapes.
    #[staticmethod]
    fn from_dict(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        let bad = |why: &str| PyValueError::new_err(format!("not a finish_reason ({why}): {d}"));
        let kind: String = d
            .get_item("type")?
            .ok_or_else(|| bad("no type"))?
            .extract()
            .map_err(|_| bad("type is not a string"))?;
        let field = |name: &str| d.get_item(name);
        match kind.as_str() {
            "stop" => {
                let matched = field("matched")?.ok_or_else(|| bad("no matched"))?;
                if let Ok(t) = matched.extract::<u32>() {
                    Ok(Self::stop_token(t))
                } else if let Ok(s) = matched.extract::<String>() {
                    Ok(Self::stop_str(s))
                } else {
                    Err(bad("matched is neither a token id nor a string"))
                }
            }
            "length" => {
                let n = field("length")?.ok_or_else(|| bad("no length"))?;
                Ok(Self::max_length(n.extract().map_err(|_| bad("length"))?))
            }
            "abort" => {
                let message = match field("message")? {
                    Some(m) => m.extract().map_err(|_| bad("message is not a string"))?,
                    None => String::new(),
                };
                let status = match field("status_code")? {
                    Some(c) if !c.is_none() => Some(c.extract().map_err(|_| bad("status_code"))?),
                    _ => None,
                };
                Ok(Self::abort(message, status))
            }
            _ => Err(bad("unknown type")),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let quote = |s: &str| -> PyResult<String> {
            Ok(pyo3::types::PyString::new(py, s).repr()?.to_string())
        };
        Ok(match self.kind {
            "stop" => match (&self.matched_str, self.matched_token) {
                (Some(s), _) => format!("FinishReason.stop_str({})", quote(s)?),
                (None, t) => format!("FinishReason.stop_token({})", t.unwrap_or_default()),
            },
            "length" => format!(
                "FinishReason.max_length({})",
                self.length.unwrap_or_default()
            ),
            _ => {
                let message = quote(self.message.as_deref().unwrap_or_default())?;
                match self.status_code {
                    Some(c) => format!("FinishReason.abort({message}, status_code={c})"),
                    None => format!("FinishReason.abort({message})"),
                }
            }
        })
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyDict>,))> {
        let from_dict = slf.get_type().getattr("from_dict")?;
        Ok((from_dict, (slf.get().to_dict(slf.py())?,)))
    }
}

/// A finished request as a commit reports it.
#[pyclass(module = "rsgl._core", name = "Finished", frozen, get_all)]
pub struct PyFinished {
    /// Request id.
    rid: u64,
    /// Why it finished.
    finish_reason: Py<PyFinishReason>,
    /// Prompt length.
    prompt_tokens: usize,
    /// Committed output tokens.
    completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    cached_tokens: usize,
}

#[pymethods]
impl PyFinished {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Finished(rid={}, finish_reason={}, completion_tokens={})",
            self.rid,
            self.finish_reason.bind(py).repr()?,
            self.completion_tokens
        ))
    }
}

fn finished_to_py(py: Python<'_>, f: Finished) -> PyResult<Py<PyFinished>> {
    Py::new(
        py,
        PyFinished {
            rid: f.rid,
            finish_reason: Py::new(py, PyFinishReason::from(f.reason))?,
            prompt_tokens: f.prompt_tokens,
            completion_tokens: f.completion_tokens,
            cached_tokens: f.cached_tokens,
        },
    )
}

fn finished_list(py: Python<'_>, v: Vec<Finished>) -> PyResult<Vec<Py<PyFinished>>> {
    v.into_iter().map(|f| finished_to_py(py, f)).collect()
}

/// A `SchedulerConfig` as the keyword arguments of `Scheduler(...)` (chunking off: -1).
fn config_to_py<'py>(py: Python<'py>, c: &SchedulerConfig) -> PyResult<Bound<'py, PyDict>> {
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
    Ok(d)
}

/// `SchedulerConfig::default()`: what `Scheduler()` runs with for each option not given.
/// The Python defaults (`rsgl.args.EngineArgs`) are tested against it.
#[pyfunction]
fn default_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    config_to_py(py, &SchedulerConfig::default())
}

/// One step's work (see the Rust `Plan` docs): per-request and per-token int64 arrays.
#[pyclass(module = "rsgl._core", name = "Plan", frozen, get_all)]
pub struct PyPlan {
    /// Sequence number; pass it to `commit`.
    id: u64,
    /// "extend", "decode", "mixed" or "idle".
    forward_mode: &'static str,
    /// Requests in the batch; the first `num_extends` extend, the rest decode.
    batch_size: usize,
    num_extends: usize,
    /// Tokens computed this step.
    num_tokens: usize,
    rids: Py<PyArray1<i64>>,
    req_slots: Py<PyArray1<i64>>,
    prefix_lens: Py<PyArray1<i64>>,
    extend_lens: Py<PyArray1<i64>>,
    seq_lens: Py<PyArray1<i64>>,
    sample: Py<PyArray1<bool>>,
    input_ids: Py<PyArray1<i64>>,
    positions: Py<PyArray1<i64>>,
    out_cache_loc: Py<PyArray1<i64>>,
    write_rows: Py<PyArray1<i64>>,
    write_cols: Py<PyArray1<i64>>,
    write_slots: Py<PyArray1<i64>>,
    admitted: Py<PyArray1<i64>>,
    retracted: Py<PyArray1<i64>>,
}

/// The forward modes a plan can have, as `'static` names.
const FORWARD_MODES: [&str; 4] = ["extend", "decode", "mixed", "idle"];

#[pymethods]
impl PyPlan {
    /// A plan built by hand (tests, benchmarks): per-request arrays must agree in length,
    /// as must the per-token ones and the `req_to_token` writes. `sample` defaults to every
    /// request, `num_extends` to all requests of an extend and none of a decode (a mixed
    /// plan must give it).
    #[new]
    #[pyo3(signature = (
        *, id=0, forward_mode="extend", rids=None, req_slots=None, prefix_lens=None,
        extend_lens=None, seq_lens=None, sample=None, input_ids=None, positions=None,
        out_cache_loc=None, write_rows=None, write_cols=None, write_slots=None, admitted=None,
        retracted=None, num_extends=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        id: u64,
        forward_mode: &str,
        rids: Option<&Bound<'_, PyAny>>,
        req_slots: Option<&Bound<'_, PyAny>>,
        prefix_lens: Option<&Bound<'_, PyAny>>,
        extend_lens: Option<&Bound<'_, PyAny>>,
        seq_lens: Option<&Bound<'_, PyAny>>,
        sample: Option<Vec<bool>>,
        input_ids: Option<&Bound<'_, PyAny>>,
        positions: Option<&Bound<'_, PyAny>>,
        out_cache_loc: Option<&Bound<'_, PyAny>>,
        write_rows: Option<&Bound<'_, PyAny>>,
        write_cols: Option<&Bound<'_, PyAny>>,
        write_slots: Option<&Bound<'_, PyAny>>,
        admitted: Option<&Bound<'_, PyAny>>,
        retracted: Option<&Bound<'_, PyAny>>,
        num_extends: Option<usize>,
    ) -> PyResult<Self> {
        let mode = FORWARD_MODES
            .into_iter()
            .find(|&m| m == forward_mode)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "forward_mode must be one of {FORWARD_MODES:?}, got {forward_mode:?}"
                ))
            })?;
        let get = |a: Option<&Bound<'_, PyAny>>, name: &str| match a {
            Some(a) => extract_i64(a, name),
            None => Ok(Vec::new()),
        };
        let rids = get(rids, "rids")?;
        let n = rids.len();
        let sample = sample.unwrap_or_else(|| vec![true; n]);
        let num_extends = match (num_extends, mode) {
            (Some(k), _) => k,
            (None, "extend") => n,
            (None, "mixed") => {
                return Err(PyValueError::new_err("a mixed plan needs num_extends"));
            }
            (None, _) => 0,
        };
        let per_request = [
            ("req_slots", get(req_slots, "req_slots")?),
            ("prefix_lens", get(prefix_lens, "prefix_lens")?),
            ("extend_lens", get(extend_lens, "extend_lens")?),
            ("seq_lens", get(seq_lens, "seq_lens")?),
        ];
        let per_token = [
            ("input_ids", get(input_ids, "input_ids")?),
            ("positions", get(positions, "positions")?),
            ("out_cache_loc", get(out_cache_loc, "out_cache_loc")?),
        ];
        let writes = [
            ("write_rows", get(write_rows, "write_rows")?),
            ("write_cols", get(write_cols, "write_cols")?),
            ("write_slots", get(write_slots, "write_slots")?),
        ];
        let same_len = |group: &[(&str, Vec<i64>)], len: usize| -> PyResult<()> {
            match group.iter().find(|(_, v)| v.len() != len) {
                Some((name, v)) => Err(PyValueError::new_err(format!(
                    "{name} has {} entries, expected {len}",
                    v.len()
                ))),
                None => Ok(()),
            }
        };
        same_len(&per_request, n)?;
        if sample.len() != n || num_extends > n {
            return Err(PyValueError::new_err(format!(
                "sample ({}) and num_extends ({num_extends}) must fit the {n} requests",
                sample.len()
            )));
        }
        let num_tokens = per_token[0].1.len();
        same_len(&per_token, num_tokens)?;
        same_len(&writes, writes[0].1.len())?;
        let [req_slots, prefix_lens, extend_lens, seq_lens] = per_request.map(|(_, v)| v);
        let [input_ids, positions, out_cache_loc] = per_token.map(|(_, v)| v);
        let [write_rows, write_cols, write_slots] = writes.map(|(_, v)| v);
        Ok(PyPlan {
            id,
            forward_mode: mode,
            batch_size: n,
            num_extends,
            num_tokens,
            rids: array(py, rids),
            req_slots: array(py, req_slots),
            prefix_lens: array(py, prefix_lens),
            extend_lens: array(py, extend_lens),
            seq_lens: array(py, seq_lens),
            sample: PyArray1::from_vec(py, sample).unbind(),
            input_ids: array(py, input_ids),
            positions: array(py, positions),
            out_cache_loc: array(py, out_cache_loc),
            write_rows: array(py, write_rows),
            write_cols: array(py, write_cols),
            write_slots: array(py, write_slots),
            admitted: array(py, get(admitted, "admitted")?),
            retracted: array(py, get(retracted, "retracted")?),
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(id={}, forward_mode={:?}, batch_size={}, num_tokens={})",
            self.id, self.forward_mode, self.batch_size, self.num_tokens
        )
    }
}

/// What a commit produced.
#[pyclass(module = "rsgl._core", name = "Outcome", frozen, get_all)]
pub struct PyOutcome {
    /// Requests that received a token, aligned with `tokens`.
    rids: Py<PyArray1<i64>>,
    tokens: Py<PyArray1<i64>>,
    /// Requests that finished (or whose deferred abort completed).
    finished: Vec<Py<PyFinished>>,
}

/// The scheduling core: one instance per model replica.
#[pyclass(module = "rsgl._core", name = "Scheduler")]
pub struct PyScheduler {
    inner: Scheduler,
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
        eos_token_ids=None, seed=None
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
        let p = self.inner.schedule();
        Ok(PyPlan {
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
            sample: PyArray1::from_vec(py, p.sample).unbind(),
            input_ids: array(py, p.input_ids),
            positions: array(py, p.positions),
            out_cache_loc: array(py, p.out_cache_loc),
            write_rows: array(py, p.write_rows),
            write_cols: array(py, p.write_cols),
            write_slots: array(py, p.write_slots),
            admitted: array(py, p.admitted),
            retracted: array(py, p.retracted),
        })
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
        Ok(PyOutcome {
            rids: array(py, out.rids),
            tokens: array(py, out.tokens),
            finished: finished_list(py, out.finished)?,
        })
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

    /// Aborts a request that was in a failed step, as `abort`, but its KV is never cached
    /// (the failed step may have written part of it). Same return values as `abort`.
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
        let items: [(&str, f64); 23] = [
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

/// The radix prefix tree on its own (for benchmarks and tools); values are KV slots.
#[pyclass(module = "rsgl._core", name = "RadixTree")]
pub struct PyRadixTree {
    inner: RadixTree,
    scratch: Vec<u32>,
}

#[pymethods]
impl PyRadixTree {
    #[new]
    #[pyo3(signature = (page_size=1, disabled=false))]
    fn new(page_size: usize, disabled: bool) -> PyResult<Self> {
        if page_size == 0 {
            return Err(PyValueError::new_err("page_size must be at least 1"));
        }
        Ok(Self {
            inner: RadixTree::new(page_size, disabled),
            scratch: Vec::new(),
        })
    }

    /// `(length, node, slots)` of the longest cached page-aligned prefix of `key`. With `out`
    /// (a uint32 array), the slots are written to `out[:length]` and `out` is returned instead
    /// of a new array.
    #[pyo3(signature = (key, out=None))]
    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        key: &Bound<'py, PyArray1<u32>>,
        out: Option<Bound<'py, PyArray1<u32>>>,
    ) -> PyResult<(usize, u32, Bound<'py, PyArray1<u32>>)> {
        let mut values = std::mem::take(&mut self.scratch);
        values.clear();
        let (n, node) = self.inner.match_prefix(readonly(key)?, &mut values);
        let Some(out) = out else {
            return Ok((n, node, PyArray1::from_vec(py, values)));
        };
        {
            let mut dst = writable(&out)?;
            let dst = dst
                .as_slice_mut()
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            if dst.len() < n {
                let msg = format!("out holds {} slots, {n} matched", dst.len());
                return Err(PyValueError::new_err(msg));
            }
            dst[..n].copy_from_slice(&values);
        }
        self.scratch = values;
        Ok((n, node, out))
    }

    /// Inserts `key` (whole pages) with `values`; returns the length already present.
    fn insert(
        &mut self,
        key: PyReadonlyArray1<'_, u32>,
        values: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<usize> {
        let key = key
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let values = values
            .as_slice()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        if key.len() != values.len() || key.len() % self.inner.page_size() != 0 {
            return Err(PyValueError::new_err(format!(
                "insert needs equal, page-aligned key and values (got {} and {})",
                key.len(),
                values.len()
            )));
        }
        Ok(self.inner.insert(key, values))
    }

    /// Protects a node's path from eviction.
    fn lock(&mut self, node: u32) -> PyResult<()> {
        self.live(node)?;
        self.inner.lock(node);
        Ok(())
    }

    /// Undoes one lock.
    fn unlock(&mut self, node: u32) -> PyResult<()> {
        self.live(node)?;
        if node != crate::radix::ROOT && self.inner.lock_ref(node) == 0 {
            return Err(PyValueError::new_err(format!("node {node} is not locked")));
        }
        self.inner.unlock(node);
        Ok(())
    }

    /// Evicts LRU leaves until `num_tokens` are freed. Returns the freed slots, or with a
    /// `pool`, hands them straight back to it and returns how many there were (no array).
    #[pyo3(signature = (num_tokens, pool=None))]
    fn evict<'py>(
        &mut self,
        py: Python<'py>,
        num_tokens: usize,
        pool: Option<PyRefMut<'py, PyTokenPool>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(mut pool) = pool else {
            let mut freed = Vec::new();
            self.inner.evict(num_tokens, &mut freed);
            return Ok(PyArray1::from_vec(py, freed).into_any());
        };
        self.scratch.clear();
        let n = self.inner.evict(num_tokens, &mut self.scratch);
        pool.inner.free(&self.scratch);
        Ok(n.into_pyobject(py)?.into_any())
    }

    /// Raises ValueError unless `node` is a node of the tree (for callers holding ids).
    fn live(&self, node: u32) -> PyResult<()> {
        if self.inner.is_live(node) {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "node {node} is not in the tree"
            )))
        }
    }

    #[getter]
    fn evictable_size(&self) -> usize {
        self.inner.evictable_size()
    }

    #[getter]
    fn protected_size(&self) -> usize {
        self.inner.protected_size()
    }

    /// Raises RuntimeError if the tree's structure or accounting is broken.
    fn check(&self) -> PyResult<()> {
        self.inner.check().map_err(PyRuntimeError::new_err)
    }
}

/// The KV slot allocator on its own (for benchmarks and tools).
#[pyclass(module = "rsgl._core", name = "TokenPool")]
pub struct PyTokenPool {
    inner: TokenPool,
}

#[pymethods]
impl PyTokenPool {
    #[new]
    #[pyo3(signature = (num_tokens, page_size=1))]
    fn new(num_tokens: usize, page_size: usize) -> PyResult<Self> {
        if page_size == 0 {
            return Err(PyValueError::new_err("page_size must be at least 1"));
        }
        Ok(Self {
            inner: TokenPool::new(num_tokens, page_size),
        })
    }

    /// Takes `n` slots, or returns None (taking nothing) if the pool is short. With `out`, the
    /// slots are written to `out[:n]` and `out` is returned.
    #[pyo3(signature = (n, out=None))]
    fn alloc<'py>(
        &mut self,
        py: Python<'py>,
        n: usize,
        out: Option<Bound<'py, PyArray1<u32>>>,
    ) -> PyResult<Option<Bound<'py, PyArray1<u32>>>> {
        let Some(out) = out else {
            return Ok(self
                .inner
                .alloc_tokens(n)
                .map(|v| PyArray1::from_vec(py, v)));
        };
        let ok = {
            let mut dst = writable(&out)?;
            let dst = dst
                .as_slice_mut()
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            if dst.len() < n {
                let msg = format!("out holds {} slots, {n} requested", dst.len());
                return Err(PyValueError::new_err(msg));
            }
            self.inner.alloc_tokens_into(&mut dst[..n])
        };
        Ok(ok.then_some(out))
    }

    /// Returns slots (runs that start on page boundaries).
    fn free(&mut self, slots: &Bound<'_, PyArray1<u32>>) -> PyResult<()> {
        self.inner.free(readonly(slots)?);
        Ok(())
    }

    #[getter]
    fn available(&self) -> usize {
        self.inner.available()
    }
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyPlan>()?;
    m.add_class::<PyOutcome>()?;
    m.add_class::<PyFinished>()?;
    m.add_class::<PyFinishReason>()?;
    m.add_function(wrap_pyfunction!(default_config, m)?)?;
    m.add_class::<PyRadixTree>()?;
    m.add_class::<PyTokenPool>()?;
    m.add("FUTURE_TOKEN", crate::scheduler::FUTURE_TOKEN)?;
    Ok(())
}
