//! `RadixTree`: the prefix tree on its own, for benchmarks and reference tests.

use super::*;

/// The radix prefix tree on its own (for benchmarks and tools); values are KV slots.
#[pyclass(module = "rsgl._core", name = "RadixTree")]
pub struct PyRadixTree {
    pub(super) inner: RadixTree,
    pub(super) scratch: Vec<u32>,
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
