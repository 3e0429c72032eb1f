//! `block_hashes`: the data-parallel dispatcher's prefix hashes (`crate::block_hash`).

use super::*;

/// The chained hashes of a prompt's whole blocks of `block` tokens (`crate::block_hashes`):
/// what the data-parallel dispatcher's prefix records hold.
#[pyfunction]
#[pyo3(signature = (tokens, block))]
pub(super) fn block_hashes(tokens: &Bound<'_, PyAny>, block: usize) -> PyResult<Vec<u64>> {
    if block == 0 {
        return Err(PyValueError::new_err("block must be at least 1"));
    }
    Ok(crate::block_hashes(
        &extract_tokens(tokens, "tokens")?,
        block,
    ))
}
