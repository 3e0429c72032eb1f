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
use crate::scheduler::{AbortStatus, CoreError, Finished, Plan, Scheduler, SchedulerConfig};

mod block_hash;
mod convert;
mod detokenizer;
mod finish_reason;
mod ngram;
mod plan;
mod pool;
mod radix;
mod scheduler;

use block_hash::*;
use convert::*;
use detokenizer::*;
use finish_reason::*;
use ngram::*;
use plan::*;
use pool::*;
use radix::*;
use scheduler::*;

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyPlan>()?;
    m.add_class::<PyOutcome>()?;
    m.add_class::<PyFinished>()?;
    m.add_class::<PyFinishReason>()?;
    m.add_function(wrap_pyfunction!(default_config, m)?)?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_class::<PyRadixTree>()?;
    m.add_class::<PyTokenPool>()?;
    m.add_class::<PyDetokenizer>()?;
    m.add_class::<PyNgramDrafter>()?;
    m.add("FUTURE_TOKEN", crate::scheduler::FUTURE_TOKEN)?;
    Ok(())
}
