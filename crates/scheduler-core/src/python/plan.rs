//! `Plan` (from the core, or built by hand) and `Outcome`.

use super::*;

/// One step's work (see the Rust `Plan` docs): per-request and per-token int64 arrays.
#[pyclass(module = "rsgl._core", name = "Plan", frozen, get_all)]
pub struct PyPlan {
    /// Sequence number; pass it to `commit`.
    pub(super) id: u64,
    /// "extend", "decode", "mixed" or "idle".
    pub(super) forward_mode: &'static str,
    /// Requests in the batch; the first `num_extends` extend, the rest decode.
    pub(super) batch_size: usize,
    pub(super) num_extends: usize,
    /// Tokens computed this step.
    pub(super) num_tokens: usize,
    pub(super) rids: Py<PyArray1<i64>>,
    pub(super) req_slots: Py<PyArray1<i64>>,
    pub(super) prefix_lens: Py<PyArray1<i64>>,
    pub(super) extend_lens: Py<PyArray1<i64>>,
    pub(super) seq_lens: Py<PyArray1<i64>>,
    /// Drafts verified per request (0 unless it speculates; `extend_lens = 1 + draft_lens`).
    pub(super) draft_lens: Py<PyArray1<i64>>,
    pub(super) sample: Py<PyArray1<bool>>,
    pub(super) input_ids: Py<PyArray1<i64>>,
    pub(super) positions: Py<PyArray1<i64>>,
    pub(super) out_cache_loc: Py<PyArray1<i64>>,
    pub(super) write_rows: Py<PyArray1<i64>>,
    pub(super) write_cols: Py<PyArray1<i64>>,
    pub(super) write_slots: Py<PyArray1<i64>>,
    pub(super) admitted: Py<PyArray1<i64>>,
    pub(super) retracted: Py<PyArray1<i64>>,
}

/// The forward modes a plan can have, as `'static` names.
pub(super) const FORWARD_MODES: [&str; 4] = ["extend", "decode", "mixed", "idle"];

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
        retracted=None, num_extends=None, draft_lens=None
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
        draft_lens: Option<&Bound<'_, PyAny>>,
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
            (
                "draft_lens",
                match draft_lens {
                    Some(a) => extract_i64(a, "draft_lens")?,
                    None => vec![0; n],
                },
            ),
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
        let [req_slots, prefix_lens, extend_lens, seq_lens, draft_lens] =
            per_request.map(|(_, v)| v);
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
            draft_lens: array(py, draft_lens),
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
    pub(super) rids: Py<PyArray1<i64>>,
    pub(super) tokens: Py<PyArray1<i64>>,
    /// Requests that finished (or whose deferred abort completed).
    pub(super) finished: Vec<Py<PyFinished>>,
}
