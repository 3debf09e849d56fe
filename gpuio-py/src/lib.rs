//! `gpuio._native`: the Python bindings' extension module (PyO3). The package `gpuio`
//! (`python/gpuio`) re-exports it and adds the safetensors drop-ins; see gpuio-py/README.md.
//!
//! Thin by design: every operation is the library's, with Python memory extracted into the
//! library's destination types (`memory`), its futures run without the GIL (`runner`), and
//! its errors mapped onto one exception hierarchy (`errors`).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod errors;
mod file;
mod memory;
mod runner;
mod safetensors;

use pyo3::prelude::*;

/// Whether a usable CUDA device exists (cached after the first call).
#[pyfunction]
fn cuda_available() -> bool {
    gpuio::cuda::available()
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<file::Engine>()?;
    m.add_class::<file::File>()?;
    m.add_class::<safetensors::SafetensorsFile>()?;
    m.add_class::<safetensors::LoadPlan>()?;
    m.add_function(wrap_pyfunction!(safetensors::open_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
