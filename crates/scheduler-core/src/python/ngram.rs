//! `NgramDrafter`: one request's n-gram index (`crate::drafter`), for benchmarks and tests
//! that replay token sequences through the drafter the scheduler uses.

use super::*;

use crate::drafter::NgramDrafter;

/// The scheduler's n-gram drafter over one token sequence: `extend` appends committed
/// tokens, `propose(k)` returns up to `k` tokens that followed the most recent earlier
/// occurrence of the longest suffix of `min..=max` tokens that occurred before.
#[pyclass(module = "rsgl._core", name = "NgramDrafter")]
pub struct PyNgramDrafter {
    inner: NgramDrafter,
}

#[pymethods]
impl PyNgramDrafter {
    #[new]
    #[pyo3(signature = (min_window=1, max_window=12))]
    fn new(min_window: usize, max_window: usize) -> Self {
        Self {
            inner: NgramDrafter::new(min_window, max_window),
        }
    }

    /// Appends committed tokens in order.
    fn extend(&mut self, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.extend(extract_tokens(tokens, "tokens")?);
        Ok(())
    }

    /// Up to `k` drafts: what the scheduler would propose after these tokens.
    fn propose(&self, k: usize) -> Vec<u32> {
        self.inner.propose(k).to_vec()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}
