//! Owned host buffers whose memory the kernel may write in place (`File::read_owned`).
//!
//! Only types whose bytes live on the heap, away from the value itself, qualify: moving a
//! `Vec<u8>`, `BytesMut` or `AlignedBuf` (into the reactor and back) leaves its bytes where
//! they are, so an address taken once stays good for as long as the value lives and is not
//! touched. Which type a caller's `B` is, is found out with `Any` (no new trait to implement);
//! every other buffer goes through bounce slots.

use std::any::Any;
use std::marker::PhantomData;

use bytes::BytesMut;

use super::aligned::AlignedBuf;

/// Which heap buffer type a `B` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OwnedKind {
    Vec,
    Bytes,
    Aligned,
}

/// The buffer, as its concrete type.
enum Heap {
    Vec(Vec<u8>),
    Bytes(BytesMut),
    Aligned(AlignedBuf),
}

/// A caller's `B` known to be one of the heap buffer types.
pub(crate) struct OwnedHostBuf<B> {
    heap: Heap,
    _b: PhantomData<fn() -> B>,
}

/// Moves `b` out if it is a `T`, else gives it back.
fn cast<B: 'static, T: 'static>(b: B) -> Result<T, B> {
    let mut slot = Some(b);
    match (&mut slot as &mut dyn Any)
        .downcast_mut::<Option<T>>()
        .and_then(Option::take)
    {
        Some(t) => Ok(t),
        None => Err(slot.take().expect("the slot was filled above")),
    }
}

impl<B: 'static> OwnedHostBuf<B> {
    /// `b` as a heap buffer, or `b` back if it is of another type.
    pub(crate) fn take(b: B) -> Result<Self, B> {
        let heap = match cast::<B, Vec<u8>>(b) {
            Ok(v) => Heap::Vec(v),
            Err(b) => match cast::<B, BytesMut>(b) {
                Ok(v) => Heap::Bytes(v),
                Err(b) => Heap::Aligned(cast::<B, AlignedBuf>(b)?),
            },
        };
        Ok(OwnedHostBuf {
            heap,
            _b: PhantomData,
        })
    }

    pub(crate) fn kind(&self) -> OwnedKind {
        match self.heap {
            Heap::Vec(_) => OwnedKind::Vec,
            Heap::Bytes(_) => OwnedKind::Bytes,
            Heap::Aligned(_) => OwnedKind::Aligned,
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.heap {
            Heap::Vec(v) => v,
            Heap::Bytes(v) => v,
            Heap::Aligned(v) => v,
        }
    }

    /// Address and length of the bytes a read fills (stable while the value is not touched).
    pub(crate) fn addr_len(&mut self) -> (usize, usize) {
        let s = self.as_mut_slice();
        (s.as_mut_ptr() as usize, s.len())
    }

    /// The caller's buffer again.
    pub(crate) fn into_original(self) -> B {
        let back = match self.heap {
            Heap::Vec(v) => cast::<Vec<u8>, B>(v).ok(),
            Heap::Bytes(v) => cast::<BytesMut, B>(v).ok(),
            Heap::Aligned(v) => cast::<AlignedBuf, B>(v).ok(),
        };
        // `take` made `heap` from a `B` of exactly this type.
        back.expect("an owned buffer comes back as the type it went in as")
    }

    /// Type-erased, for the reactor to hold.
    pub(crate) fn into_any(self) -> Box<dyn Any + Send> {
        match self.heap {
            Heap::Vec(v) => Box::new(v),
            Heap::Bytes(v) => Box::new(v),
            Heap::Aligned(v) => Box::new(v),
        }
    }

    /// The buffer the reactor handed back (`None` if it is not of `kind`).
    pub(crate) fn from_any(any: Box<dyn Any + Send>, kind: OwnedKind) -> Option<Self> {
        let heap = match kind {
            OwnedKind::Vec => Heap::Vec(*any.downcast::<Vec<u8>>().ok()?),
            OwnedKind::Bytes => Heap::Bytes(*any.downcast::<BytesMut>().ok()?),
            OwnedKind::Aligned => Heap::Aligned(*any.downcast::<AlignedBuf>().ok()?),
        };
        Some(OwnedHostBuf {
            heap,
            _b: PhantomData,
        })
    }

    /// An empty buffer of `kind` (standing in for one the engine had to leak).
    pub(crate) fn empty(kind: OwnedKind) -> Self {
        let heap = match kind {
            OwnedKind::Vec => Heap::Vec(Vec::new()),
            OwnedKind::Bytes => Heap::Bytes(BytesMut::new()),
            OwnedKind::Aligned => Heap::Aligned(AlignedBuf::default()),
        };
        OwnedHostBuf {
            heap,
            _b: PhantomData,
        }
    }
}
