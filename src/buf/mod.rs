//! Buffers: what reads can fill and writes can drain, and the bounce memory in between.
//!
//! Borrowed destinations ([`ReadDst`]) and sources ([`WriteSrc`]) are never handed to the
//! kernel. Data passes through reactor-owned bounce slots and is copied between slot and
//! caller memory inside the future's own `poll` (see [`crate::reactor`] for why that is the
//! soundness argument). Owned buffers ([`IoBufMut`], [`IoBuf`]) move into the operation and
//! come back with its result.

pub(crate) mod aligned;
pub(crate) mod arena;
#[cfg(feature = "cuda")]
mod device;
pub(crate) mod owned;
pub(crate) mod quarantine;
#[cfg(feature = "cuda")]
pub mod raw_device;
pub(crate) mod region;

use bytes::{Bytes, BytesMut};

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// Where a read's bytes go (implementation detail of [`ReadDst`]).
#[doc(hidden)]
pub enum ReadTarget<'a> {
    /// Host memory.
    Host(&'a mut [u8]),
    /// Device memory.
    #[cfg(feature = "cuda")]
    Device(&'a mut dyn crate::cuda::DeviceDst),
}

impl ReadTarget<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            ReadTarget::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            ReadTarget::Device(d) => d.byte_len(),
        }
    }
}

/// Where a write's bytes come from (implementation detail of [`WriteSrc`]).
#[doc(hidden)]
pub enum WriteSource<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// Device memory.
    #[cfg(feature = "cuda")]
    Device(&'a dyn crate::cuda::DeviceSrc),
}

impl WriteSource<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            WriteSource::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            WriteSource::Device(d) => d.byte_len(),
        }
    }
}

/// A destination `File::read_into` can fill: its whole current length is the request.
///
/// Host: `[u8]`, `[u8; N]`, `Vec<u8>`, `BytesMut` and [`AlignedBuf`](crate::AlignedBuf) (their
/// initialized length, like a slice).
/// Device (feature `cuda`): cudarc's `CudaSlice<T>` and `CudaViewMut<T>` for any [`Pod`]
/// element type, viewed as bytes; memory another library allocated, as a
/// [`RawDeviceSlice`](crate::RawDeviceSlice). Sealed.
///
/// [`Pod`]: crate::cuda::Pod
pub trait ReadDst: sealed::Sealed + Send {
    /// Where the bytes go.
    #[doc(hidden)]
    fn target(&mut self) -> ReadTarget<'_>;
}

/// A source `File::write_from` can write: its whole current length is the request.
///
/// Host: `[u8]`, `[u8; N]`, `Vec<u8>`, `Bytes`, `BytesMut`, `str`, `String`,
/// [`AlignedBuf`](crate::AlignedBuf). Device (feature
/// `cuda`): `CudaSlice<T>`, `CudaView<T>`, `CudaViewMut<T>`, `RawDeviceSlice`. Sealed.
pub trait WriteSrc: sealed::Sealed + Sync {
    /// Where the bytes come from.
    #[doc(hidden)]
    fn source(&self) -> WriteSource<'_>;
}

impl sealed::Sealed for [u8] {}
impl<const N: usize> sealed::Sealed for [u8; N] {}
impl sealed::Sealed for Vec<u8> {}
impl sealed::Sealed for BytesMut {}
impl sealed::Sealed for Bytes {}
impl sealed::Sealed for str {}
impl sealed::Sealed for String {}
impl<T: WriteSrc + ?Sized> sealed::Sealed for &T {}

impl ReadDst for [u8] {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Host(self)
    }
}
impl<const N: usize> ReadDst for [u8; N] {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Host(self)
    }
}
impl ReadDst for Vec<u8> {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Host(self)
    }
}
impl ReadDst for BytesMut {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Host(self)
    }
}

impl WriteSrc for [u8] {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self)
    }
}
/// A reference is a source of what it refers to (so `&[u8]`, which is sized, can stand behind
/// a `&dyn WriteSrc`).
impl<T: WriteSrc + ?Sized> WriteSrc for &T {
    fn source(&self) -> WriteSource<'_> {
        (**self).source()
    }
}
impl<const N: usize> WriteSrc for [u8; N] {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self)
    }
}
impl WriteSrc for Vec<u8> {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self)
    }
}
impl WriteSrc for BytesMut {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self)
    }
}
impl WriteSrc for Bytes {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self)
    }
}
impl WriteSrc for str {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self.as_bytes())
    }
}
impl WriteSrc for String {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self.as_bytes())
    }
}

/// An owned buffer a read can fill and hand back (`File::read_owned`).
pub trait IoBufMut: ReadDst + Sized + 'static {}
impl<T: ReadDst + Sized + 'static> IoBufMut for T {}

/// An owned buffer a write can drain and hand back (`File::write_owned`).
pub trait IoBuf: WriteSrc + Send + Sized + 'static {}
impl<T: WriteSrc + Send + Sized + 'static> IoBuf for T {}
