//! cudarc's device memory as read destinations and write sources: `CudaSlice<T>` and
//! `CudaViewMut<T>` are [`ReadDst`]s, those and `CudaView<T>` are [`WriteSrc`]s, for element
//! types whose every bit pattern is valid ([`Pod`]).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::sealed::Sealed;
use super::{ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::cuda::Pod;

macro_rules! write_src {
    ($($ty:ty),*) => {$(
        impl<T: Pod> Sealed for $ty {}
        impl<T: Pod> WriteSrc for $ty {
            fn source(&self) -> WriteSource<'_> {
                WriteSource::Device(self)
            }
        }
    )*};
}

macro_rules! read_dst {
    ($($ty:ty),*) => {$(
        impl<T: Pod> ReadDst for $ty {
            fn target(&mut self) -> ReadTarget<'_> {
                ReadTarget::Device(self)
            }
        }
    )*};
}

write_src!(CudaSlice<T>, CudaViewMut<'_, T>, CudaView<'_, T>);
read_dst!(CudaSlice<T>, CudaViewMut<'_, T>);
