//! Conversions at the boundary: core errors to Python exceptions, numpy arrays and
//! sequences to vectors and back.

use super::*;

pub(super) fn to_py_err(e: CoreError) -> PyErr {
    match e {
        CoreError::InvalidRequest(m) => PyValueError::new_err(m),
        CoreError::Protocol(m) => PyRuntimeError::new_err(m),
    }
}

/// Token ids from a numpy integer array or any sequence of ints, checked to fit `u32`.
pub(super) fn extract_tokens(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
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
pub(super) fn extract_i64(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<i64>> {
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
pub(super) fn readonly<'a>(a: &'a Bound<'_, PyArray1<u32>>) -> PyResult<&'a [u32]> {
    // SAFETY: see above.
    unsafe { a.as_slice() }.map_err(|e| PyValueError::new_err(format!("array: {e}")))
}

/// A writeable view of an `out` array (numpy's borrow tracking rejects read-only arrays).
pub(super) fn writable<'py>(
    a: &Bound<'py, PyArray1<u32>>,
) -> PyResult<PyReadwriteArray1<'py, u32>> {
    a.try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out array: {e}")))
}

pub(super) fn array<'py>(py: Python<'py>, v: Vec<i64>) -> Py<PyArray1<i64>> {
    PyArray1::from_vec(py, v).unbind()
}
