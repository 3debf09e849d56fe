//! Buffers: what reads can fill and writes can drain, and the bounce memory in between.
//!
//! Borrowed destinations ([`ReadDst`]) and sources ([`WriteSrc`]) are never handed to the
//! kernel. Data passes through reactor-owned bounce slots and is copied between slot and
//! caller memory inside the future's own `poll` (see [`crate::reactor`] for why that is the
//! soundness argument). Owned buffers ([`IoBufMut`], [`IoBuf`]) move into the operation and
//! come back with its result.

pub(crate) mod arena;

use bytes::{Bytes, BytesMut};

mod sealed {
    pub trait Sealed {}
}

/// A destination `File::read_into` can fill: its whole current length is the request.
///
/// Implemented for `[u8]`, `[u8; N]`, `Vec<u8>` and `BytesMut` (their initialized length, like
/// a slice). Sealed: the set grows with device memory types.
pub trait ReadDst: sealed::Sealed + Send {
    /// The bytes to fill.
    #[doc(hidden)]
    fn host_bytes_mut(&mut self) -> &mut [u8];
}

/// A source `File::write_from` can write: its whole current length is the request.
pub trait WriteSrc: sealed::Sealed + Sync {
    /// The bytes to write.
    #[doc(hidden)]
    fn host_bytes(&self) -> &[u8];
}

impl sealed::Sealed for [u8] {}
impl<const N: usize> sealed::Sealed for [u8; N] {}
impl sealed::Sealed for Vec<u8> {}
impl sealed::Sealed for BytesMut {}
impl sealed::Sealed for Bytes {}
impl sealed::Sealed for str {}
impl sealed::Sealed for String {}

impl ReadDst for [u8] {
    fn host_bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
impl<const N: usize> ReadDst for [u8; N] {
    fn host_bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
impl ReadDst for Vec<u8> {
    fn host_bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}
impl ReadDst for BytesMut {
    fn host_bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl WriteSrc for [u8] {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl<const N: usize> WriteSrc for [u8; N] {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl WriteSrc for Vec<u8> {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl WriteSrc for BytesMut {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl WriteSrc for Bytes {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl WriteSrc for str {
    fn host_bytes(&self) -> &[u8] {
        self.as_bytes()
    }
}
impl WriteSrc for String {
    fn host_bytes(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// An owned buffer a read can fill and hand back (`File::read_owned`).
pub trait IoBufMut: ReadDst + Sized + 'static {}
impl<T: ReadDst + Sized + 'static> IoBufMut for T {}

/// An owned buffer a write can drain and hand back (`File::write_owned`).
pub trait IoBuf: WriteSrc + Send + Sized + 'static {}
impl<T: WriteSrc + Send + Sized + 'static> IoBuf for T {}
