//! gpuio's errors as Python exceptions: one `gpuio.Error` hierarchy (defined in
//! `gpuio/_errors.py`, so its classes can also derive from `OSError`, `ValueError`, ...), each
//! carrying the library's op, path, offset, backend and peer agent as attributes and in its
//! message.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// The Python class for a library error, by name in `gpuio._errors`.
fn class_name(e: &gpuio::Error) -> &'static str {
    match e {
        gpuio::Error::Io { .. } => "IoError",
        gpuio::Error::InvalidInput { .. } => "InvalidInput",
        gpuio::Error::UnexpectedEof { .. } => "UnexpectedEof",
        gpuio::Error::Unsupported { .. } => "Unsupported",
        gpuio::Error::Shutdown { .. } => "ShutDown",
        gpuio::Error::Cuda { .. } => "CudaError",
        gpuio::Error::PoolExhausted { .. } => "PoolExhausted",
        gpuio::Error::ReactorDied { .. } => "ReactorDied",
        _ => "Error",
    }
}

/// Converts a library error into the matching `gpuio` exception.
pub fn to_py(e: gpuio::Error) -> PyErr {
    to_py_ref(&e)
}

/// [`to_py`] for an error shared by several parties (one failed transfer awaited by several
/// callers): the library's errors are not `Clone`, so each party builds its own exception.
pub fn to_py_ref(e: &gpuio::Error) -> PyErr {
    Python::attach(|py| build(py, e).unwrap_or_else(|import_failed| import_failed))
}

/// An operation's error, turned into the `gpuio` exception once the result reaches Python
/// (`runner::spawn`).
pub trait IntoPyErr: Send + 'static {
    /// The exception.
    fn into_py_err(self) -> PyErr;
}

impl IntoPyErr for gpuio::Error {
    fn into_py_err(self) -> PyErr {
        to_py(self)
    }
}

impl IntoPyErr for std::sync::Arc<gpuio::Error> {
    fn into_py_err(self) -> PyErr {
        to_py_ref(&self)
    }
}

fn build(py: Python<'_>, e: &gpuio::Error) -> PyResult<PyErr> {
    let module = py.import("gpuio._errors")?;
    let class = module.getattr(class_name(e))?;
    let message = e.to_string();
    let ctx = e.context();
    let path = ctx.path.as_ref().map(|p| p.display().to_string());
    // OSError subclasses take (errno, strerror, filename): `errno` and `filename` then work
    // as they do for the standard library's own I/O errors.
    let args = match e.raw_os_error() {
        Some(errno) => PyTuple::new(
            py,
            [
                errno.into_pyobject(py)?.into_any(),
                message.into_pyobject(py)?.into_any(),
                path.clone().into_pyobject(py)?.into_any(),
            ],
        )?,
        None => PyTuple::new(py, [message.into_pyobject(py)?.into_any()])?,
    };
    let exc = class.call1(args)?;
    exc.setattr("op", ctx.op.to_string())?;
    exc.setattr("path", path)?;
    exc.setattr("offset", ctx.offset)?;
    exc.setattr("backend", ctx.backend)?;
    exc.setattr("peer", ctx.peer.as_deref())?;
    Ok(PyErr::from_value(exc))
}

/// `gpuio.InvalidInput` for bad Python-side input (a read-only or non-contiguous buffer).
pub fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    let message = message.into();
    let made = py
        .import("gpuio._errors")
        .and_then(|m| m.getattr("InvalidInput"))
        .and_then(|c| c.call1((message.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// An integer argument as `T`, or `gpuio.InvalidInput` naming the argument. Arguments are
/// taken as `i128` so that a negative or oversized value reaches this check: PyO3's own
/// conversion to an unsigned type raises an `OverflowError` that does not say which argument
/// was wrong.
pub fn int_arg<T: TryFrom<i128>>(py: Python<'_>, name: &str, v: i128) -> PyResult<T> {
    T::try_from(v).map_err(|_| {
        invalid(
            py,
            if v < 0 {
                format!("{name}: {v} is negative (want 0 or more)")
            } else {
                format!("{name}: {v} is too large")
            },
        )
    })
}

/// [`int_arg`] for an optional argument.
pub fn opt_int_arg<T: TryFrom<i128>>(
    py: Python<'_>,
    name: &str,
    v: Option<i128>,
) -> PyResult<Option<T>> {
    v.map(|v| int_arg(py, name, v)).transpose()
}
