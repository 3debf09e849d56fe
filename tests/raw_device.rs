//! [`RawDeviceSlice`]: device memory known only by its address (what the Python and C
//! bindings hand over). Every test says loudly that it skipped where no usable CUDA device
//! exists.

mod common;

use common::*;
use gpuio::{Engine, RawDeviceSlice};

#[test]
fn raw_slice_without_cuda_is_unsupported() {
    if gpuio::cuda::available() {
        skipped("raw_slice_without_cuda_is_unsupported: this machine has a GPU");
        return;
    }
    // SAFETY: without CUDA `new` fails before anything uses the address.
    let e = unsafe { RawDeviceSlice::new(0, 0x1000, 16) }.unwrap_err();
    assert!(matches!(e, gpuio::Error::Unsupported { .. }), "{e}");
    let e = RawDeviceSlice::device_of(0x1000).unwrap_err();
    assert!(matches!(e, gpuio::Error::Unsupported { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_slice_reads_writes_and_refuses_host_memory() {
    if !gpuio::cuda::available() {
        skipped("raw_slice_reads_writes_and_refuses_host_memory: no usable CUDA device");
        return;
    }
    use gpuio::cuda::cudarc::driver::DevicePtr;
    let ctx = gpuio::cuda::context(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let dir = tmpdir();
    const LEN: usize = (8 << 20) + 333;
    let (path, _) = test_file(dir.path(), "raw", LEN, 3);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let d = stream.alloc_zeros::<u8>(LEN).unwrap();
    let (ptr, guard) = d.device_ptr(&stream);
    drop(guard);
    // SAFETY: `d` is LEN bytes of device memory on GPU 0, used on `stream`, and outlives the
    // read (the stream is synchronised before it is freed or read back).
    let mut raw = unsafe { RawDeviceSlice::new(0, ptr + 5, LEN - 5) }
        .unwrap()
        .with_stream(stream.clone())
        .unwrap();
    let n = f.read_into(&mut raw, 7).await.unwrap();
    assert_eq!(n, LEN - 7, "short only at end of file");
    stream.synchronize().unwrap();
    let back = stream.clone_dtoh(&d).unwrap();
    assert_eq!(&back[5..5 + n], &pread_ref(&path, 7, n)[..]);
    assert!(
        back[..5].iter().all(|&b| b == 0),
        "bytes before the range untouched"
    );

    // Written back out from the same raw range: the file copy matches.
    let out = engine.create(dir.path().join("out.bin")).unwrap();
    assert_eq!(out.write_from(&raw, 0).await.unwrap(), LEN - 5);
    stream.synchronize().unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("out.bin")).unwrap(),
        back[5..].to_vec()
    );

    assert_eq!(RawDeviceSlice::device_of(ptr + 100).unwrap(), 0);

    // Host memory is refused with a reason, not written through.
    let host = vec![0u8; 4096];
    let e = RawDeviceSlice::device_of(host.as_ptr() as u64).unwrap_err();
    assert!(matches!(e, gpuio::Error::InvalidInput { .. }), "{e}");
    // SAFETY: `new` only asks the driver about the address and fails; nothing is written.
    let e = unsafe { RawDeviceSlice::new(0, host.as_ptr() as u64, host.len()) }.unwrap_err();
    assert!(matches!(e, gpuio::Error::InvalidInput { .. }), "{e}");
    drop(d);
}
