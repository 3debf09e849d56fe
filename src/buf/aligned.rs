//! [`AlignedBuf`]: owned host memory aligned for O_DIRECT.

use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::ptr::NonNull;

use super::{ReadDst, ReadTarget, WriteSource, WriteSrc, sealed};

/// Owned, zero-initialised host memory whose first byte is aligned to
/// [`AlignedBuf::ALIGN`] (4 KiB), the alignment O_DIRECT asks of memory on common devices.
///
/// Handed to [`File::read_owned`](crate::File::read_owned), it lets the kernel read straight
/// into it under O_DIRECT too (offset and length aligned as well), where a `Vec<u8>`'s
/// allocator-chosen address would send the read through bounce slots. It is a `[u8]`
/// otherwise (`Deref`), and a destination and source like any other host buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively, like a `Box<[u8]>`; shared access only
// reads through `&[u8]`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` gives out only `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// The alignment of the first byte.
    pub const ALIGN: usize = 4096;

    fn layout(len: usize) -> Layout {
        match Layout::from_size_align(len, Self::ALIGN) {
            Ok(l) => l,
            // Only a length within ALIGN of isize::MAX gets here; no allocator could serve it.
            Err(_) => handle_alloc_error(Layout::new::<[u8; Self::ALIGN]>()),
        }
    }

    /// `len` zero bytes (no allocation for 0). Aborts (as `Vec` does) if the memory cannot
    /// be allocated.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            // Aligned and never dereferenced (empty slices only), like `NonNull::dangling`.
            let ptr = NonNull::new(Self::ALIGN as *mut u8).unwrap_or(NonNull::dangling());
            return AlignedBuf { ptr, len };
        }
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size (len > 0).
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: a non-empty buffer's `ptr` came from `alloc_zeroed` with this same
            // layout and is freed only here.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl Default for AlignedBuf {
    /// An empty buffer (no allocation).
    fn default() -> Self {
        AlignedBuf::zeroed(0)
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is non-null and aligned, and points to `len` initialised bytes
        // (zeroed at allocation; none when empty) that this value owns; the borrow of `self`
        // keeps them alive and unaliased by `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        let mut c = AlignedBuf::zeroed(self.len);
        c.copy_from_slice(self);
        c
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

impl sealed::Sealed for AlignedBuf {}

impl ReadDst for AlignedBuf {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Host(self)
    }
}

impl WriteSrc for AlignedBuf {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Host(self)
    }
}

#[cfg(test)]
mod tests {
    use super::AlignedBuf;

    #[test]
    fn aligned_zeroed_and_owned() {
        for len in [0, 1, 4095, 4096, 1 << 20] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.is_empty(), len == 0);
            assert_eq!(b.as_ptr() as usize % AlignedBuf::ALIGN, 0, "len {len}");
            assert!(b.iter().all(|&x| x == 0));
            b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
            assert_eq!(c.as_ptr() as usize % AlignedBuf::ALIGN, 0);
        }
    }
}
