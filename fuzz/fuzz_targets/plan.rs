//! The request planner, for random offsets, lengths, alignments and chunk sizes: every plan
//! covers exactly the requested bytes (writes) or their aligned envelope (reads), in aligned
//! pieces, once each, each fitting a bounce slot; overflowing ranges are errors, never panics.
//! The checks themselves live next to the planner (`gpuio::fuzzing`), where the unit tests
//! run them too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; 26];
    let n = data.len().min(b.len());
    b[..n].copy_from_slice(&data[..n]);
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let offset = word(0);
    // Mostly modest lengths (every piece checked), sometimes anything (checked at the ends).
    let len = if b[24] & 1 == 0 { word(8) % (64 << 20) } else { word(8) };
    // Powers of two up to 64 KiB, sometimes anything (must be refused cleanly).
    let align = if b[24] & 2 == 0 { 1u64 << (b[25] % 17) } else { u64::from(b[25]) };
    let chunk = (word(16) % (16 << 20)) as usize + 1;
    if let Err(e) = gpuio::fuzzing::check_read_plan(offset, len, align, chunk) {
        panic!("read plan {offset} {len} {align} {chunk}: {e}");
    }
    if let Err(e) = gpuio::fuzzing::check_write_plan(offset, len, align, chunk) {
        panic!("write plan {offset} {len} {align} {chunk}: {e}");
    }
});
