//! `File::read_owned` with buffers the kernel can fill in place (`Vec<u8>`, `BytesMut`):
//! contents, short reads at the end of the file, the bounce fallback (O_DIRECT with an
//! unaligned buffer), and futures dropped or leaked with the read in the kernel.

mod common;

use common::*;
use gpuio::{AlignedBuf, OpenOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_reads_fill_the_buffer_and_give_it_back() {
    let dir = tmpdir();
    // Several 256 KiB pieces, an odd offset and length.
    let (path, data) = test_file(dir.path(), "data", 3_000_000, 21);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let (r, v) = within(f.read_owned(vec![0u8; 1_234_567], 17)).await;
        assert_eq!(r.unwrap(), 1_234_567, "{name}");
        assert!(v == data[17..17 + 1_234_567], "{name}: Vec contents");
        let (r, b) = within(f.read_owned(bytes::BytesMut::zeroed(700_001), 1_000_000)).await;
        assert_eq!(r.unwrap(), 700_001, "{name}");
        assert!(
            b[..] == data[1_000_000..1_700_001],
            "{name}: BytesMut contents"
        );
        // Past the end: the count stops there, the rest of the buffer is as it was.
        let (r, v) = within(f.read_owned(vec![0xEEu8; 600_000], 2_500_000)).await;
        assert_eq!(r.unwrap(), 500_000, "{name}");
        assert!(v[..500_000] == data[2_500_000..], "{name}: tail contents");
        assert!(
            v[500_000..].iter().all(|&x| x == 0xEE),
            "{name}: bytes past the end"
        );
        let (r, v) = within(f.read_owned(vec![1u8; 10], 3_000_000)).await;
        assert_eq!((r.unwrap(), v), (0, vec![1u8; 10]), "{name}: at the end");
        let (r, v) = within(f.read_owned(Vec::new(), 5)).await;
        assert_eq!((r.unwrap(), v.len()), (0, 0), "{name}: empty buffer");
        // Bad input: an error, and the buffer back untouched.
        let (r, v) = within(f.read_owned(vec![3u8; 8], u64::MAX - 2)).await;
        assert!(r.is_err(), "{name}: offset past the largest file offset");
        assert_eq!(v, vec![3u8; 8]);
        let w = gpuio::OpenOptions::new()
            .write(true)
            .open(&engine, &path)
            .unwrap();
        let (r, v) = within(w.read_owned(vec![4u8; 8], 0)).await;
        assert!(r.is_err(), "{name}: file opened without read access");
        assert_eq!(v, vec![4u8; 8]);
    }
}

/// O_DIRECT: aligned ranges into a `Vec` (whose address the allocator chose, so in place or
/// through bounce slots as it falls) and unaligned ones (always bounce slots) read the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_reads_under_o_direct() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "direct", 2 << 20, 22);
    for (name, engine) in engines() {
        if !direct_ok(&engine, &path) {
            continue;
        }
        let f = OpenOptions::new()
            .read(true)
            .direct(true)
            .open(&engine, &path)
            .unwrap();
        for (off, len) in [(0u64, 1usize << 20), (4096, 8192), (1000, 70_000), (3, 5)] {
            let (r, v) = within(f.read_owned(vec![0u8; len], off)).await;
            assert_eq!(r.unwrap(), len, "{name} {off}+{len}");
            assert!(
                v == data[off as usize..off as usize + len],
                "{name} {off}+{len}"
            );
            // Aligned memory: in place wherever offset and length are aligned too.
            let (r, a) = within(f.read_owned(AlignedBuf::zeroed(len), off)).await;
            assert_eq!(r.unwrap(), len, "{name} aligned {off}+{len}");
            assert!(
                a[..] == data[off as usize..off as usize + len],
                "{name} aligned {off}+{len}"
            );
        }
        // The end of the file in the middle of an aligned read.
        let (r, a) = within(f.read_owned(AlignedBuf::zeroed(1 << 20), (2 << 20) - 8192)).await;
        assert_eq!(r.unwrap(), 8192, "{name}");
        assert!(a[..8192] == data[(2 << 20) - 8192..], "{name}");
        assert!(
            a[8192..].iter().all(|&x| x == 0),
            "{name}: bytes past the end"
        );
    }
}

/// Dropped and leaked owned reads mid-flight: the engine keeps serving correct reads, and
/// shuts down (it waits for the abandoned pieces to land in the buffers it holds).
#[test]
fn dropped_and_leaked_owned_reads_leave_the_engine_usable() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "big", 32 << 20, 23);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // A slow engine and a 32 MiB file, so reads are still in the kernel when their futures
    // go away.
    for (name, engine) in slow_engines("the owned-read abandon test") {
        for direct in [false, true] {
            let f = match OpenOptions::new()
                .read(true)
                .direct(direct)
                .open(&engine, &path)
            {
                Ok(f) => f,
                Err(e) => {
                    skipped(format!("O_DIRECT part of the owned abandon test: {e}"));
                    continue;
                }
            };
            for (i, leak) in [false, true, false, true].into_iter().enumerate() {
                let fut = Box::pin(f.read_owned(vec![0u8; 32 << 20], 0));
                abandon_mid_flight(fut, i as u64, leak);
                // In place under O_DIRECT too.
                let fut = Box::pin(f.read_owned(AlignedBuf::zeroed(32 << 20), 0));
                abandon_mid_flight(fut, i as u64, leak);
            }
            let (r, v) = rt.block_on(within(f.read_owned(vec![0u8; 3 << 20], 5 << 20)));
            assert_eq!(r.unwrap(), 3 << 20, "{name} direct={direct}");
            assert!(v == data[5 << 20..8 << 20], "{name} direct={direct}");
        }
        rt.block_on(within(engine.shutdown())).unwrap();
    }
}
