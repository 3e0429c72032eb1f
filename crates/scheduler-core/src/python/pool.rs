//! `TokenPool`: the KV slot allocator on its own.

use super::*;

/// The KV slot allocator on its own (for benchmarks and tools).
#[pyclass(module = "rsgl._core", name = "TokenPool")]
pub struct PyTokenPool {
    pub(super) inner: TokenPool,
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
