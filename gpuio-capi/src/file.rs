//! Files: open and close, size, and the synchronous reads and writes.

use std::sync::{Arc, Weak};

use crate::engine::{ENGINES, EngineHandle, refuse_on_executor};
use crate::registry::Registry;
use crate::status::{Failure, gpuio_status, guard};
use crate::{
    GPUIO_OPEN_CREATE, GPUIO_OPEN_DIRECT, GPUIO_OPEN_READ, GPUIO_OPEN_TRUNCATE, GPUIO_OPEN_WRITE,
    memory,
};

/// An open file on an engine. Opaque; `gpuio_open`, `gpuio_close`.
pub struct gpuio_file {
    _opaque: [u8; 0],
}

/// What a file handle holds.
pub(crate) struct FileHandle {
    pub(crate) file: gpuio::File,
    /// The engine's handle, gone once the engine is freed.
    engine: Weak<EngineHandle>,
}

impl FileHandle {
    /// The engine handle, or `GPUIO_ERR_SHUTDOWN` once it was freed.
    pub(crate) fn engine(&self) -> Result<Arc<EngineHandle>, Failure> {
        // A task finishing on the executor may hold the handle a moment after the free: the
        // closed flag says it is being freed either way.
        self.engine
            .upgrade()
            .filter(|e| !e.is_closed())
            .ok_or_else(|| {
                Failure::new(
                    gpuio_status::GPUIO_ERR_SHUTDOWN,
                    format!(
                        "{}: the engine this file was opened on has been freed",
                        self.file.path().display()
                    ),
                )
            })
    }
}

pub(crate) static FILES: Registry<FileHandle> = Registry::new("gpuio_file");

const ALL_OPEN_FLAGS: u32 = GPUIO_OPEN_READ
    | GPUIO_OPEN_WRITE
    | GPUIO_OPEN_CREATE
    | GPUIO_OPEN_TRUNCATE
    | GPUIO_OPEN_DIRECT;

/// Opens `path` on `engine` with `flags` (`GPUIO_OPEN_*`, or-ed: READ and/or WRITE, CREATE and
/// TRUNCATE need WRITE, DIRECT for O_DIRECT: any offset and length still work) and stores the
/// handle in `*out`. Unknown flag bits are `GPUIO_ERR_INVALID`.
///
/// # Safety
/// `path` is NULL (an error) or a NUL-terminated string; `out` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_open(
    engine: *const crate::engine::gpuio_engine,
    path: *const libc::c_char,
    flags: u32,
    out: *mut *mut gpuio_file,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("gpuio_open: out is a null pointer"));
        }
        let handle = ENGINES.get(engine)?;
        // SAFETY: forwarded from this function's contract.
        let path = unsafe { crate::text::c_path(path, "gpuio_open") }?;
        if flags & !ALL_OPEN_FLAGS != 0 {
            return Err(Failure::invalid(format!(
                "gpuio_open {}: unknown flag bits {:#x} (GPUIO_OPEN_READ, WRITE, CREATE, \
                 TRUNCATE, DIRECT)",
                path.display(),
                flags & !ALL_OPEN_FLAGS
            )));
        }
        let file = gpuio::OpenOptions::new()
            .read(flags & GPUIO_OPEN_READ != 0)
            .write(flags & GPUIO_OPEN_WRITE != 0)
            .create(flags & GPUIO_OPEN_CREATE != 0)
            .truncate(flags & GPUIO_OPEN_TRUNCATE != 0)
            .direct(flags & GPUIO_OPEN_DIRECT != 0)
            .open(&handle.engine, &path)?;
        let token = FILES.insert(Arc::new(FileHandle {
            file,
            engine: Arc::downgrade(&handle),
        }));
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { *out = std::ptr::without_provenance_mut(token as usize) };
        Ok(())
    })
}

/// Closes a file. Requests still running on it keep it open until they complete; the handle
/// is dead at once.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_close(file: *mut gpuio_file) -> gpuio_status {
    guard(|| FILES.remove(file).map(drop))
}

/// Stores the file's size in bytes in `*size`.
///
/// # Safety
/// `size` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_file_size(file: *const gpuio_file, size: *mut u64) -> gpuio_status {
    guard(|| {
        if size.is_null() {
            return Err(Failure::invalid("gpuio_file_size: size is a null pointer"));
        }
        let len = FILES.get(file)?.file.len()?;
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { *size = len };
        Ok(())
    })
}

/// Reads `dst->len` bytes at `offset` into `dst` (host or device memory) and stores the bytes
/// read in `*bytes` (if not NULL): fewer only at end of file. Blocks the calling thread.
///
/// # Safety
/// `dst` is NULL (an error) or a readable `gpuio_buffer` whose memory stays valid during the
/// call; `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_read(
    file: *const gpuio_file,
    dst: *const memory::gpuio_buffer,
    offset: u64,
    bytes: *mut u64,
) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_read")?;
        let handle = FILES.get(file)?;
        let engine = handle.engine()?;
        // SAFETY: forwarded from this function's contract; the call ends after the read.
        let dst = unsafe { memory::dst(&engine, dst) }?;
        let n = match dst {
            // Lent for the call, so the kernel may read into it in place.
            memory::Dst::Host(buf) => handle.file.read_into_blocking(buf, offset),
            dst => futures::executor::block_on(dst.read(&handle.file, offset)),
        }?;
        // SAFETY: `bytes` is NULL or writable (this function's contract).
        unsafe { store(bytes, n) };
        Ok(())
    })
}

/// Writes all of `src` (host or device memory) at `offset`; `*bytes` (if not NULL) gets
/// `src->len`. Never a short write reported as success. Blocks the calling thread.
///
/// # Safety
/// As for `gpuio_read`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_write(
    file: *const gpuio_file,
    src: *const memory::gpuio_buffer,
    offset: u64,
    bytes: *mut u64,
) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_write")?;
        let handle = FILES.get(file)?;
        let engine = handle.engine()?;
        // SAFETY: forwarded from this function's contract; the call ends after the write.
        let src = unsafe { memory::src(&engine, src) }?;
        let n = futures::executor::block_on(src.write(&handle.file, offset))?;
        // SAFETY: `bytes` is NULL or writable (this function's contract).
        unsafe { store(bytes, n) };
        Ok(())
    })
}

/// Flushes the file's data and metadata to stable storage (`fsync`). Blocks.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_fsync(file: *const gpuio_file) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_fsync")?;
        let handle = FILES.get(file)?;
        handle.engine()?;
        futures::executor::block_on(handle.file.sync_all())?;
        Ok(())
    })
}

/// Stores `n` in `*out` where the caller asked for it.
///
/// # Safety
/// `out` is NULL or writable.
pub(crate) unsafe fn store(out: *mut u64, n: usize) {
    if !out.is_null() {
        // SAFETY: non-null, and writable by this function's contract.
        unsafe { *out = n as u64 };
    }
}
