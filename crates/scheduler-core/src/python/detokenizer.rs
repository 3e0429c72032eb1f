//! `Detokenizer`: every running request's incremental text, one call per step.

use super::*;

use pyo3::exceptions::PyKeyError;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::detokenize::{ByteTable, DetokenizeError, Detokenizer, TextHandle, TextOptions};

fn to_key_err(e: DetokenizeError) -> PyErr {
    PyKeyError::new_err(e.to_string())
}

/// Incremental detokenization of byte-level BPE output for every running request: text
/// deltas and stop strings of a whole step in one call (see `crate::detokenize`).
///
/// Built once from the tokenizer's token bytes and special ids; `add` starts a request and
/// returns its handle, `step` takes one step's tokens of many requests, `finish` returns the
/// text held back for stop strings, `remove` forgets the request.
#[pyclass(module = "rsgl._core", name = "Detokenizer")]
pub struct PyDetokenizer {
    inner: Detokenizer,
    /// A step's tokens laid end to end, request `i`'s ending at `token_ends[i]`; its text
    /// likewise. Kept between steps so a step allocates nothing per request.
    tokens: Vec<u32>,
    token_ends: Vec<usize>,
    text: String,
    text_ends: Vec<usize>,
}

#[pymethods]
impl PyDetokenizer {
    #[new]
    #[pyo3(signature = (token_bytes, special=None))]
    fn new(
        token_bytes: Vec<Bound<'_, PyBytes>>,
        special: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let tokens: Vec<&[u8]> = token_bytes.iter().map(|b| b.as_bytes()).collect();
        let mut ids = Vec::new();
        if let Some(special) = special {
            for id in special.try_iter()? {
                ids.push(id?.extract::<u32>()?);
            }
        }
        Ok(Self {
            inner: Detokenizer::new(ByteTable::new(&tokens, ids)),
            tokens: Vec::new(),
            token_ends: Vec::new(),
            text: String::new(),
            text_ends: Vec::new(),
        })
    }

    /// Starts a request's text; returns its handle.
    #[pyo3(signature = (stop=Vec::new(), skip_special_tokens=true, no_stop_trim=false))]
    fn add(
        &mut self,
        stop: Vec<Bound<'_, PyString>>,
        skip_special_tokens: bool,
        no_stop_trim: bool,
    ) -> PyResult<TextHandle> {
        let mut options = TextOptions {
            skip_special_tokens,
            no_stop_trim,
            ..TextOptions::default()
        };
        for s in stop {
            match s.to_str() {
                Ok(s) => options.stop.push(s.to_owned()),
                // A lone surrogate: no decoded text contains it, but it holds back its
                // length, as Python's own stop-string check would.
                Err(_) => options.extra_holdback = options.extra_holdback.max(s.len()?),
            }
        }
        Ok(self.inner.add(options))
    }

    /// One step: `token_ids[i]` are the new tokens of request `handles[i]`. Returns each
    /// request's newly final text, and `(i, tokens, stop)` for each request whose text
    /// reached stop string `stop` with its `tokens`-th new token (the later ones are not
    /// part of its text). An id beyond the table has no text, as in the tokenizer's
    /// `decode`. KeyError (nothing taken) if a handle is unknown.
    ///
    /// The GIL stays held: the whole step takes microseconds, less than getting the GIL
    /// back from a Python thread that took it meanwhile could cost the loop.
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        handles: Vec<TextHandle>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        self.read_tokens(token_ids)?;
        if handles.len() != self.token_ends.len() {
            return Err(PyValueError::new_err(format!(
                "{} handles but {} token lists",
                handles.len(),
                self.token_ends.len()
            )));
        }
        if let Some(&h) = handles.iter().find(|&&h| !self.inner.contains(h)) {
            return Err(to_key_err(DetokenizeError::UnknownHandle(h)));
        }
        self.text.clear();
        self.text_ends.clear();
        let stops = PyList::empty(py);
        let mut start = 0;
        for (i, (&h, &end)) in handles.iter().zip(&self.token_ends).enumerate() {
            let tokens = self.tokens[start..end].iter().copied();
            let stop = self
                .inner
                .push(h, tokens, &mut self.text)
                .map_err(to_key_err)?;
            start = end;
            self.text_ends.push(self.text.len());
            if let Some(m) = stop {
                let matched = self.inner.matched_stop(h).map_err(to_key_err)?;
                let entry = (i, m.tokens, matched).into_pyobject(py)?;
                stops.append::<Bound<'_, PyTuple>>(entry)?;
            }
        }
        let mut from = 0;
        let texts = PyList::new(
            py,
            self.text_ends.iter().map(|&end| {
                let text = &self.text[from..end];
                from = end;
                text
            }),
        )?;
        Ok((texts, stops))
    }

    /// The stop string that ended a request's text, or None.
    fn matched_stop(&self, handle: TextHandle) -> PyResult<Option<String>> {
        let matched = self.inner.matched_stop(handle).map_err(to_key_err)?;
        Ok(matched.map(str::to_owned))
    }

    /// The rest of a request's text once it is over (the part held back for stop strings;
    /// an incomplete character at the very end is dropped). It takes no more text after.
    fn finish(&mut self, handle: TextHandle) -> PyResult<String> {
        self.inner.finish(handle).map_err(to_key_err)
    }

    /// Forgets a request; its handle becomes unknown.
    fn remove(&mut self, handle: TextHandle) -> PyResult<()> {
        self.inner.remove(handle).map_err(to_key_err)
    }

    /// Tokens in the table.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.table().len()
    }

    /// Requests added and not yet removed.
    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

impl PyDetokenizer {
    /// Reads a step's token lists into `tokens` / `token_ends`. An id that is no token at
    /// all (a negative one) has no text either: it becomes one beyond the table.
    fn read_tokens(&mut self, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        self.tokens.clear();
        self.token_ends.clear();
        let id = |t: Bound<'_, PyAny>| -> PyResult<u32> {
            Ok(u32::try_from(t.extract::<i64>()?).unwrap_or(u32::MAX))
        };
        for ids in token_ids.try_iter()? {
            let ids = ids?;
            // Lists (what the loop sends) without the iterator protocol's overhead.
            if let Ok(list) = ids.cast::<PyList>() {
                for t in list.iter() {
                    self.tokens.push(id(t)?);
                }
            } else {
                for t in ids.try_iter()? {
                    self.tokens.push(id(t?)?);
                }
            }
            self.token_ends.push(self.tokens.len());
        }
        Ok(())
    }
}
