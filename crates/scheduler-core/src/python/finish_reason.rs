//! `FinishReason` and `Finished`: how a request ended, typed.

use super::*;

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
    pub(super) kind: &'static str,
    /// The stop or EOS token that ended it.
    pub(super) matched_token: Option<u32>,
    /// The stop string that ended it.
    pub(super) matched_str: Option<String>,
    /// The output length that ended it.
    pub(super) length: Option<usize>,
    /// Why it was aborted.
    pub(super) message: Option<String>,
    /// The HTTP status of a server-side abort (400, 500, 503, ...); None for a client's.
    pub(super) status_code: Option<u16>,
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
    pub(super) rid: u64,
    /// Why it finished.
    pub(super) finish_reason: Py<PyFinishReason>,
    /// Prompt length.
    pub(super) prompt_tokens: usize,
    /// Committed output tokens.
    pub(super) completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub(super) cached_tokens: usize,
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

pub(super) fn finished_to_py(py: Python<'_>, f: Finished) -> PyResult<Py<PyFinished>> {
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

pub(super) fn finished_list(py: Python<'_>, v: Vec<Finished>) -> PyResult<Vec<Py<PyFinished>>> {
    v.into_iter().map(|f| finished_to_py(py, f)).collect()
}
