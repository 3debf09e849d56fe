//! Request planning: how a byte range becomes chunk-sized, aligned I/O pieces.
//!
//! Reads widen the range to the O_DIRECT alignment (`align`, 1 for buffered I/O) and split it
//! at `chunk`-byte boundaries; each piece lands in its own bounce slot and the caller gets only
//! the bytes it asked for. Writes cannot widen (that would overwrite neighbouring bytes), so an
//! O_DIRECT write sends its aligned middle through the direct descriptor and its unaligned head
//! and tail through a buffered descriptor of the same file: the kernel keeps the two coherent
//! (direct I/O flushes and invalidates the page cache over its range), and no read-modify-write
//! of a shared block races with other writers.
//!
//! The file layer plans writes with the alignment rounded up to a page, so within one write the
//! buffered edges and the direct middle never share a page. Across *concurrent* writes, one
//! write's buffered edge can still dirty a page another write covers with O_DIRECT; the kernel
//! then fails to invalidate that page after the direct write and reports it (EIO at the next
//! fsync, "Page cache invalidation failure" in the kernel log). Writers that need O_DIRECT
//! and overlap pages concurrently should align their own writes to pages.

pub mod align;
pub mod residency;
pub mod sizing;

/// Which descriptor of a file a piece goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// The file's main descriptor (O_DIRECT when the file was opened `direct`).
    Main,
    /// The buffered twin of an O_DIRECT file (unaligned write edges).
    Buffered,
    /// The O_DIRECT twin of a buffered file: read pieces the page cache mostly lacks
    /// ([`residency`]).
    Direct,
}

/// One I/O: `len` bytes at file position `pos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) pos: u64,
    pub(crate) len: usize,
    pub(crate) via: Via,
}

/// Largest position the kernel accepts (`loff_t` is signed).
pub(crate) const MAX_POS: u64 = i64::MAX as u64;

/// Why a range cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PlanError {
    /// `offset + len` overflows or passes the kernel's largest offset.
    Overflow,
    /// Alignment larger than the chunk can ever be.
    Alignment(u64),
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanError::Overflow => write!(
                f,
                "offset + length overflows the largest file offset ({MAX_POS})"
            ),
            PlanError::Alignment(a) => write!(f, "alignment {a} is not a power of two"),
        }
    }
}

/// Chunk size used for a given alignment: a multiple of `align`, at least `align`.
fn effective_chunk(chunk: usize, align: u64) -> usize {
    let a = align as usize;
    (chunk / a).max(1) * a
}

/// The pieces of a read of `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReadPlan {
    start: u64,
    end: u64,
    chunk: usize,
}

impl ReadPlan {
    /// Plans a read. `align` is a power of two (1 for buffered I/O).
    pub(crate) fn new(offset: u64, len: u64, align: u64, chunk: usize) -> Result<Self, PlanError> {
        if !align.is_power_of_two() {
            return Err(PlanError::Alignment(align));
        }
        let end = offset.checked_add(len).ok_or(PlanError::Overflow)?;
        let aligned_end = end
            .checked_next_multiple_of(align)
            .ok_or(PlanError::Overflow)?;
        if aligned_end > MAX_POS {
            return Err(PlanError::Overflow);
        }
        let start = offset - offset % align;
        let end = if len == 0 { start } else { aligned_end };
        Ok(ReadPlan {
            start,
            end,
            chunk: effective_chunk(chunk, align),
        })
    }

    /// Number of pieces.
    pub(crate) fn len(&self) -> usize {
        (self.end - self.start).div_ceil(self.chunk as u64) as usize
    }

    /// Piece `i` (`i < len()`).
    pub(crate) fn piece(&self, i: usize) -> Piece {
        let pos = self.start + i as u64 * self.chunk as u64;
        let len = (self.end - pos).min(self.chunk as u64) as usize;
        Piece {
            pos,
            len,
            via: Via::Main,
        }
    }
}

/// The pieces of a write of `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WritePlan {
    head: Option<(u64, usize)>,
    mid_start: u64,
    mid_end: u64,
    tail: Option<(u64, usize)>,
    chunk: usize,
}

impl WritePlan {
    /// Plans a write. With `align > 1` (O_DIRECT) unaligned edges go [`Via::Buffered`].
    pub(crate) fn new(offset: u64, len: u64, align: u64, chunk: usize) -> Result<Self, PlanError> {
        if !align.is_power_of_two() {
            return Err(PlanError::Alignment(align));
        }
        let end = offset.checked_add(len).ok_or(PlanError::Overflow)?;
        if end > MAX_POS {
            return Err(PlanError::Overflow);
        }
        let chunk = effective_chunk(chunk, align);
        // The aligned middle [mid_start, mid_end); may be empty.
        let mid_start = offset.next_multiple_of(align).min(end);
        let mid_end = (end - end % align).max(mid_start);
        let (head, tail, mid_start, mid_end) = if mid_start >= mid_end {
            // No whole block inside: buffered edges only, split where the range crosses a
            // block boundary so that each lies in one block (and fits a chunk-sized slot even
            // when the chunk is a single block).
            let boundary = offset.next_multiple_of(align);
            if len == 0 {
                (None, None, offset, offset)
            } else if boundary > offset && boundary < end {
                let head = (offset, (boundary - offset) as usize);
                let tail = (boundary, (end - boundary) as usize);
                (Some(head), Some(tail), boundary, boundary)
            } else {
                (Some((offset, len as usize)), None, offset, offset)
            }
        } else {
            let head = (mid_start > offset).then(|| (offset, (mid_start - offset) as usize));
            let tail = (end > mid_end).then(|| (mid_end, (end - mid_end) as usize));
            (head, tail, mid_start, mid_end)
        };
        // Edges longer than a chunk (only possible when align == 1, where they are empty) are
        // not produced: with align == 1 the middle is the whole range.
        Ok(WritePlan {
            head,
            mid_start,
            mid_end,
            tail,
            chunk,
        })
    }

    fn mid_pieces(&self) -> usize {
        (self.mid_end - self.mid_start).div_ceil(self.chunk as u64) as usize
    }

    /// Number of pieces.
    pub(crate) fn len(&self) -> usize {
        self.head.is_some() as usize + self.mid_pieces() + self.tail.is_some() as usize
    }

    /// Piece `i` (`i < len()`).
    pub(crate) fn piece(&self, mut i: usize) -> Piece {
        if let Some((pos, len)) = self.head {
            if i == 0 {
                return Piece {
                    pos,
                    len,
                    via: Via::Buffered,
                };
            }
            i -= 1;
        }
        if i < self.mid_pieces() {
            let pos = self.mid_start + i as u64 * self.chunk as u64;
            let len = (self.mid_end - pos).min(self.chunk as u64) as usize;
            return Piece {
                pos,
                len,
                via: Via::Main,
            };
        }
        let (pos, len) = self.tail.expect("piece index out of range");
        Piece {
            pos,
            len,
            via: Via::Buffered,
        }
    }
}

/// Pieces checked one by one; beyond this the first and last ones are checked and the count
/// is checked by arithmetic, so that huge ranges cost the checker no more than small ones.
#[cfg(any(test, fuzzing))]
const CHECK_ALL_UP_TO: usize = 1 << 12;

/// The piece indices the checkers look at: all of them, or the first and last few.
#[cfg(any(test, fuzzing))]
fn checked_indices(n: usize) -> Vec<usize> {
    if n <= CHECK_ALL_UP_TO {
        (0..n).collect()
    } else {
        (0..64).chain(n - 64..n).collect()
    }
}

/// What both checks say about refusals: `Ok(None)` where the planner rightly refused (an
/// alignment that is not a power of two, or a range whose end, `end`, is past the largest
/// offset: `None`), the plan and its end where it rightly planned, an error otherwise.
#[cfg(any(test, fuzzing))]
fn check_refusal<P: std::fmt::Debug>(
    plan: Result<P, PlanError>,
    align: u64,
    end: Option<u64>,
) -> Result<Option<(P, u64)>, String> {
    if !align.is_power_of_two() {
        return match plan {
            Err(PlanError::Alignment(a)) if a == align => Ok(None),
            other => Err(format!("alignment {align} accepted: {other:?}")),
        };
    }
    match (plan, end) {
        (Err(PlanError::Overflow), None) => Ok(None),
        (Ok(p), Some(e)) => Ok(Some((p, e))),
        (other, _) => Err(format!("overflow check wrong: {other:?}")),
    }
}

/// Checks a read plan against what the reactor relies on: errors exactly when the range
/// overflows or the alignment is not a power of two; otherwise pieces that tile the aligned
/// envelope of `[offset, offset + len)` (widened by less than one block each side) in order,
/// without gaps or overlaps, each aligned in position and length and no longer than the
/// chunk a bounce slot holds. Used by the tests and the `plan` fuzz target.
#[cfg(any(test, fuzzing))]
pub fn check_read_plan(offset: u64, len: u64, align: u64, chunk: usize) -> Result<(), String> {
    let envelope_end = offset
        .checked_add(len)
        .and_then(|e| e.checked_next_multiple_of(align))
        .filter(|&e| e <= MAX_POS);
    let Some((plan, end)) = check_refusal(
        ReadPlan::new(offset, len, align, chunk),
        align,
        envelope_end,
    )?
    else {
        return Ok(());
    };
    let slot = chunk.max(align as usize);
    if len == 0 {
        return match plan.len() {
            0 => Ok(()),
            n => Err(format!("empty read planned as {n} pieces")),
        };
    }
    let start = offset - offset % align;
    let n = plan.len();
    let eff = plan.chunk as u64;
    if eff % align != 0 || eff > slot as u64 || eff == 0 {
        return Err(format!("chunk {eff} for align {align}, chunk {chunk}"));
    }
    if n as u64 != (end - start).div_ceil(eff) {
        return Err(format!("{n} pieces for {} bytes of {eff}", end - start));
    }
    let mut prev: Option<Piece> = None;
    for i in checked_indices(n) {
        let p = plan.piece(i);
        let want_pos = start + i as u64 * eff;
        if p.pos != want_pos || p.via != Via::Main {
            return Err(format!("piece {i} {p:?}, expected at {want_pos}"));
        }
        if p.pos % align != 0 || p.len as u64 % align != 0 || p.len == 0 || p.len > slot {
            return Err(format!(
                "piece {i} {p:?} misaligned or sized wrong (slot {slot})"
            ));
        }
        if let Some(q) = prev.filter(|_| i > 0) {
            if q.pos + q.len as u64 > p.pos {
                return Err(format!("pieces overlap: {q:?} {p:?}"));
            }
        }
        if i == n - 1 && p.pos + p.len as u64 != end {
            return Err(format!("last piece {p:?} does not end at {end}"));
        }
        prev = Some(p);
    }
    Ok(())
}

/// Checks a write plan: errors exactly when the range overflows or the alignment is not a
/// power of two; otherwise pieces that cover exactly `[offset, offset + len)` once, in order;
/// direct (`Main`) pieces aligned in position and length; buffered pieces only where
/// `align > 1`, only first or last, each shorter than one block (so no block is written both
/// ways); every piece no longer than the chunk a bounce slot holds.
#[cfg(any(test, fuzzing))]
pub fn check_write_plan(offset: u64, len: u64, align: u64, chunk: usize) -> Result<(), String> {
    let end = offset.checked_add(len).filter(|&e| e <= MAX_POS);
    let Some((plan, end)) = check_refusal(WritePlan::new(offset, len, align, chunk), align, end)?
    else {
        return Ok(());
    };
    let slot = chunk.max(align as usize);
    let n = plan.len();
    if len == 0 {
        return match n {
            0 => Ok(()),
            n => Err(format!("empty write planned as {n} pieces")),
        };
    }
    let all = n <= CHECK_ALL_UP_TO;
    let mut covered = 0u64;
    let mut prev: Option<Piece> = None;
    for i in checked_indices(n) {
        let p = plan.piece(i);
        if p.len == 0 || p.len > slot {
            return Err(format!("piece {i} {p:?} sized wrong (slot {slot})"));
        }
        match p.via {
            Via::Main if p.pos % align != 0 || p.len as u64 % align != 0 => {
                return Err(format!("direct piece {i} {p:?} misaligned for {align}"));
            }
            Via::Buffered if align == 1 => {
                return Err(format!("buffered piece {i} {p:?} without alignment"));
            }
            Via::Buffered if p.len as u64 >= align || (i != 0 && i != n - 1) => {
                return Err(format!("buffered piece {i} {p:?} of {n} for align {align}"));
            }
            Via::Buffered if p.pos / align != (p.pos + p.len as u64 - 1) / align => {
                return Err(format!("buffered piece {i} {p:?} straddles a block"));
            }
            _ => {}
        }
        match prev {
            Some(q) if i > 0 && all && q.pos + q.len as u64 != p.pos => {
                return Err(format!("gap or overlap between {q:?} and {p:?}"));
            }
            Some(q) if i > 0 && q.pos + q.len as u64 > p.pos => {
                return Err(format!("overlap between {q:?} and {p:?}"));
            }
            None if p.pos != offset => return Err(format!("first piece {p:?} not at {offset}")),
            _ => {}
        }
        if i == n - 1 && p.pos + p.len as u64 != end {
            return Err(format!("last piece {p:?} does not end at {end}"));
        }
        covered += p.len as u64;
        prev = Some(p);
    }
    if all && covered != len {
        return Err(format!("{covered} bytes covered of {len}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_pieces(off: u64, len: u64, align: u64, chunk: usize) -> Vec<Piece> {
        let p = ReadPlan::new(off, len, align, chunk).unwrap();
        (0..p.len()).map(|i| p.piece(i)).collect()
    }

    fn write_pieces(off: u64, len: u64, align: u64, chunk: usize) -> Vec<Piece> {
        let p = WritePlan::new(off, len, align, chunk).unwrap();
        (0..p.len()).map(|i| p.piece(i)).collect()
    }

    #[test]
    fn buffered_read_splits_at_chunks() {
        let v = read_pieces(10, 25, 1, 10);
        let got: Vec<_> = v.iter().map(|p| (p.pos, p.len)).collect();
        assert_eq!(got, vec![(10, 10), (20, 10), (30, 5)]);
        assert!(read_pieces(5, 0, 1, 10).is_empty());
    }

    #[test]
    fn direct_read_widens_to_alignment() {
        let v = read_pieces(4095, 2, 4096, 1 << 20);
        let got: Vec<_> = v.iter().map(|p| (p.pos, p.len)).collect();
        assert_eq!(got, vec![(0, 8192)]);
        let v = read_pieces(5000, 1, 512, 4096);
        assert_eq!((v[0].pos, v[0].len), (4608, 512));
    }

    #[test]
    fn overflow_is_an_error_not_a_panic() {
        assert_eq!(
            ReadPlan::new(u64::MAX, 1, 1, 4096),
            Err(PlanError::Overflow)
        );
        assert_eq!(
            ReadPlan::new(MAX_POS - 10, 100, 4096, 4096),
            Err(PlanError::Overflow)
        );
        assert_eq!(
            WritePlan::new(u64::MAX - 1, 5, 1, 4096),
            Err(PlanError::Overflow)
        );
        assert!(ReadPlan::new(0, 1, 3, 4096).is_err());
    }

    #[test]
    fn direct_write_sends_edges_buffered() {
        let v = write_pieces(100, 10_000, 4096, 4096);
        let got: Vec<_> = v.iter().map(|p| (p.pos, p.len, p.via)).collect();
        assert_eq!(
            got,
            vec![
                (100, 3996, Via::Buffered),
                (4096, 4096, Via::Main),
                (8192, 1908, Via::Buffered)
            ]
        );
        // Inside one block: one buffered piece.
        let v = write_pieces(10, 20, 4096, 4096);
        assert_eq!(
            v,
            vec![Piece {
                pos: 10,
                len: 20,
                via: Via::Buffered
            }]
        );
        assert!(write_pieces(10, 0, 4096, 4096).is_empty());
    }

    /// The checkers the fuzz target uses, on many random shapes (including chunks no larger
    /// than the alignment, where a whole-buffered write once exceeded its slot).
    #[test]
    fn random_plans_pass_the_checkers() {
        let mut rng = fastrand::Rng::with_seed(3);
        for i in 0..200_000 {
            let align = 1u64 << rng.u32(0..14);
            let chunk = match i % 3 {
                0 => rng.usize(1..200_000),
                1 => align as usize * rng.usize(1..4),
                _ => 4096 << rng.u32(0..6),
            };
            let off = match i % 4 {
                0 => rng.u64(..),
                1 => MAX_POS - rng.u64(0..1 << 20),
                _ => rng.u64(0..100_000),
            };
            let len = match i % 5 {
                0 => rng.u64(..),
                _ => rng.u64(0..300_000),
            };
            check_read_plan(off, len, align, chunk)
                .unwrap_or_else(|e| panic!("read {off} {len} {align} {chunk}: {e}"));
            check_write_plan(off, len, align, chunk)
                .unwrap_or_else(|e| panic!("write {off} {len} {align} {chunk}: {e}"));
        }
        // A few non-powers of two.
        for align in [0, 3, 4095, 6000] {
            check_read_plan(0, 10, align, 4096).unwrap();
            check_write_plan(0, 10, align, 4096).unwrap();
        }
    }
}
