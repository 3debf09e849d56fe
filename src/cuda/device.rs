//! Device memory as the copy paths see it ([`DeviceDst`], [`DeviceSrc`]): cudarc's `CudaSlice<T>`,
//! `CudaViewMut<T>` (destinations) and `CudaView<T>` (sources), for element types whose every
//! bit pattern is valid ([`Pod`]), viewed as bytes.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    SyncOnDrop,
};

mod pod_sealed {
    pub trait Sealed {}
}

/// Element types any bytes are a valid value of, so file bytes may land in them.
pub trait Pod: DeviceRepr + pod_sealed::Sealed + Send + Sync + 'static {}

macro_rules! pod {
    ($($t:ty),*) => {$(impl pod_sealed::Sealed for $t {} impl Pod for $t {})*};
}
pod!(
    u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64
);

/// Device memory a read can write (implementation detail of [`ReadDst`]).
#[doc(hidden)]
pub trait DeviceDst: Send {
    /// Bytes to fill.
    fn byte_len(&self) -> usize;
    /// The stream the memory belongs to.
    fn own_stream(&self) -> &Arc<CudaStream>;
    /// Device pointer for writing on `stream`; dropping the guard records cudarc's write event.
    fn write_ptr<'s>(&'s mut self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>);
}

/// Device memory a write can read (implementation detail of [`WriteSrc`]).
#[doc(hidden)]
pub trait DeviceSrc: Send + Sync {
    /// Bytes to write.
    fn byte_len(&self) -> usize;
    /// The stream the memory belongs to.
    fn own_stream(&self) -> &Arc<CudaStream>;
    /// Device pointer for reading on `stream`; dropping the guard records cudarc's read event.
    fn read_ptr<'s>(&'s self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>);
}

macro_rules! device_src {
    ($($ty:ty),*) => {$(
        impl<T: Pod> DeviceSrc for $ty {
            fn byte_len(&self) -> usize {
                DeviceSlice::num_bytes(self)
            }
            fn own_stream(&self) -> &Arc<CudaStream> {
                DeviceSlice::stream(self)
            }
            fn read_ptr<'s>(&'s self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
                DevicePtr::device_ptr(self, stream)
            }
        }
    )*};
}

macro_rules! device_dst {
    ($($ty:ty),*) => {$(
        impl<T: Pod> DeviceDst for $ty {
            fn byte_len(&self) -> usize {
                DeviceSlice::num_bytes(self)
            }
            fn own_stream(&self) -> &Arc<CudaStream> {
                DeviceSlice::stream(self)
            }
            fn write_ptr<'s>(&'s mut self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
                DevicePtrMut::device_ptr_mut(self, stream)
            }
        }
    )*};
}

device_src!(CudaSlice<T>, CudaViewMut<'_, T>, CudaView<'_, T>);
device_dst!(CudaSlice<T>, CudaViewMut<'_, T>);

/// One pointer attribute of `ptr`, written into `value`.
///
/// # Safety
/// `attr` must be an attribute whose value the driver writes as one `T`.
pub(crate) unsafe fn pointer_attribute<T>(
    value: &mut T,
    attr: cudarc::driver::sys::CUpointer_attribute,
    ptr: u64,
) -> cudarc::driver::sys::CUresult {
    // SAFETY: `value` is a live, writable `T` for the call; the caller guarantees the driver
    // writes exactly one `T` for `attr`. The driver only looks `ptr` up, never dereferences it.
    unsafe { cudarc::driver::sys::cuPointerGetAttribute((value as *mut T).cast(), attr, ptr) }
}
