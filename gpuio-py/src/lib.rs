//! `gpuio._native`: the Python bindings' extension module (PyO3). The package `gpuio`
//! (`python/gpuio`) re-exports it and adds the safetensors drop-ins; see gpuio-py/README.md.
//!
//! Thin by design: every operation is the library's, with Python memory extracted into the
//! library's destination types (`memory`), its futures run without the GIL (`runner`), and
//! its errors mapped onto one exception hierarchy (`errors`).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod agent;
mod context;
mod errors;
mod exit;
mod file;
mod hostbuf;
mod memory;
mod runner;
mod safetensors;
mod save;

use pyo3::prelude::*;

/// Whether a usable CUDA device exists (cached after the first call).
#[pyfunction]
fn cuda_available() -> bool {
    gpuio::cuda::available()
}

/// What ``gpuio check`` reports for a path: io_uring, the engine's sizing, O_DIRECT, CUDA,
/// GPUDirect Storage and SPDK, each with the reason. ``print(report)`` prints it as the
/// command does; ``report.sections`` maps each section's name to its lines.
#[pyclass(frozen, module = "gpuio._native")]
struct CheckReport {
    inner: gpuio::check::Report,
}

#[pymethods]
impl CheckReport {
    /// Section name (``gpuio``, ``io_uring``, ``engine``, ``path``, ``cuda``, ``gds``,
    /// ``spdk``) to its lines, in printing order.
    #[getter]
    fn sections(&self) -> Vec<(&'static str, Vec<String>)> {
        self.inner
            .sections
            .iter()
            .map(|s| (s.name, s.lines.clone()))
            .collect()
    }

    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        self.inner.to_string()
    }
}

/// Examines this machine and ``path`` (a file, block device or directory; default the
/// current directory) as ``gpuio check PATH`` does, and returns the report.
#[pyfunction]
#[pyo3(signature = (path = None))]
fn check(py: Python<'_>, path: Option<std::path::PathBuf>) -> PyResult<CheckReport> {
    let path = path.unwrap_or_else(|| std::path::PathBuf::from("."));
    let inner = exit::detach(py, || gpuio::check::report(&path)).map_err(errors::to_py)?;
    Ok(CheckReport { inner })
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<file::Engine>()?;
    m.add_class::<file::File>()?;
    m.add_class::<safetensors::SafetensorsFile>()?;
    m.add_class::<safetensors::LoadPlan>()?;
    m.add_class::<hostbuf::HostBuffer>()?;
    m.add_function(wrap_pyfunction!(safetensors::open_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::read_plans, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::read_plans_host, m)?)?;
    m.add_function(wrap_pyfunction!(save::save_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_class::<CheckReport>()?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<agent::DescList>()?;
    m.add_class::<agent::PreparedList>()?;
    m.add_class::<agent::Registration>()?;
    m.add_class::<agent::XferRequest>()?;
    m.add_function(wrap_pyfunction!(exit::_at_exit, m)?)?;
    exit::register_fork_handler();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
