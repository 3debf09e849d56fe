//! The range fence: I/O pieces of one file that overlap are ordered by when the reactor
//! started them, so that a piece an abandoned operation left in the kernel can never land
//! after a later operation that overlaps it.
//!
//! # Why
//! A dropped (or leaked) future cannot take back what it already gave the kernel: its write
//! pieces there complete whenever the kernel gets to them, possibly after a later write of
//! the same bytes has completed and reported `Ok`, which would leave the older data in the
//! file. io_uring and the pread pool run pieces in any order, so the reactor orders them.
//!
//! # The rule
//! Every piece gets a sequence number when the reactor starts it. A *write* piece holds its
//! range (widened to the file's grain: a page for O_DIRECT files, a sector for NVMe) from then
//! until it completes. A piece (read or write) of another operation whose widened range meets
//! a held write range with a smaller sequence number waits, outside the kernel, until that
//! range is released. Reads hold nothing: a read running alongside a later write is
//! concurrent with it, and a read's data goes to bounce memory the reactor owns.
//!
//! Pieces of one operation never wait for each other (the planner never overlaps them), and
//! the earliest waiting piece waits only for pieces already in the kernel, which complete: the
//! fence cannot deadlock. Widening to pages also keeps one write's buffered edge off a page
//! that another write's O_DIRECT piece covers at the same time, which the kernel would report
//! as a page-cache invalidation failure (EIO at the next fsync).
//!
//! The fence is per engine (one reactor sees every piece it starts), keyed by file identity
//! (device and inode), so two `File`s opened on the same path are ordered too. Operations on
//! other engines or processes are not.

use std::collections::BTreeMap;

use crate::target::FileKey;

/// A piece's place in the fence: the widened range it covers and when it started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    file: FileKey,
    start: u64,
    end: u64,
    seq: u64,
    op: usize,
    /// The range is held (write pieces) and must be released.
    held: bool,
}

/// A held write range.
#[derive(Debug, Clone, Copy)]
struct Held {
    end: u64,
    op: usize,
}

/// Held ranges of one file, keyed by (start, sequence number).
#[derive(Default)]
struct FileRanges {
    held: BTreeMap<(u64, u64), Held>,
    /// Longest held range: a range that meets `[s, e)` starts after `s - longest`.
    longest: u64,
}

/// Write ranges in flight per file, and the sequence counter. Files are few (those with
/// writes in the kernel right now), so a short vector searched in order beats hashing on
/// every piece.
#[derive(Default)]
pub(crate) struct RangeFence {
    files: Vec<(FileKey, FileRanges)>,
    next_seq: u64,
}

impl RangeFence {
    /// Registers a piece of op `op` covering `[pos, pos + len)`, widened to `grain` (a power of
    /// two). Write pieces hold their range until [`release`](Self::release).
    pub(crate) fn start(
        &mut self,
        file: FileKey,
        pos: u64,
        len: u64,
        grain: u64,
        op: usize,
        write: bool,
    ) -> Ticket {
        let grain = grain.max(1);
        let start = pos - pos % grain;
        let end = pos
            .saturating_add(len)
            .checked_next_multiple_of(grain)
            .unwrap_or(u64::MAX);
        let seq = self.next_seq;
        self.next_seq += 1;
        if write {
            let i = match self.files.iter().position(|(k, _)| *k == file) {
                Some(i) => i,
                None => {
                    self.files.push((file, FileRanges::default()));
                    self.files.len() - 1
                }
            };
            let f = &mut self.files[i].1;
            f.held.insert((start, seq), Held { end, op });
            f.longest = f.longest.max(end - start);
        }
        Ticket {
            file,
            start,
            end,
            seq,
            op,
            held: write,
        }
    }

    /// Whether the piece must wait: a write range of another op, started earlier, meets it.
    pub(crate) fn blocked(&self, t: &Ticket) -> bool {
        if self.files.is_empty() {
            // The common read-only case: no write is in flight anywhere.
            return false;
        }
        let Some((_, f)) = self.files.iter().find(|(k, _)| *k == t.file) else {
            return false;
        };
        let from = t.start.saturating_sub(f.longest);
        f.held
            .range((from, 0)..(t.end, 0))
            .any(|(&(_, seq), h)| seq < t.seq && h.op != t.op && h.end > t.start)
    }

    /// Ends a piece's hold on its range (a no-op for pieces that held none).
    pub(crate) fn release(&mut self, t: &Ticket) {
        if !t.held {
            return;
        }
        if let Some(i) = self.files.iter().position(|(k, _)| *k == t.file) {
            let f = &mut self.files[i].1;
            f.held.remove(&(t.start, t.seq));
            if f.held.is_empty() {
                self.files.swap_remove(i);
            }
        }
    }

    /// Write ranges held now (tests).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.files.iter().map(|(_, f)| f.held.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: FileKey = FileKey { dev: 1, ino: 2 };
    const G: FileKey = FileKey { dev: 1, ino: 3 };

    #[test]
    fn later_overlapping_pieces_wait_for_earlier_writes() {
        let mut fence = RangeFence::default();
        let w = fence.start(F, 0, 100, 1, 1, true);
        assert!(!fence.blocked(&w), "nothing earlier");
        let r = fence.start(F, 50, 10, 1, 2, false);
        let w2 = fence.start(F, 99, 1, 1, 3, true);
        let apart = fence.start(F, 100, 10, 1, 4, true);
        let other_file = fence.start(G, 0, 100, 1, 5, true);
        assert!(fence.blocked(&r), "a later read meets the write");
        assert!(fence.blocked(&w2), "a later write meets the write");
        assert!(!fence.blocked(&apart), "[100, 110) does not meet [0, 100)");
        assert!(!fence.blocked(&other_file));
        // The earlier write never waits for the later ones.
        assert!(!fence.blocked(&w));
        fence.release(&w);
        assert!(!fence.blocked(&r));
        assert!(!fence.blocked(&w2));
        for t in [r, w2, apart, other_file] {
            fence.release(&t);
        }
        assert_eq!(fence.held(), 0);
        assert!(fence.files.is_empty());
    }

    #[test]
    fn pieces_of_one_op_never_wait_for_each_other() {
        let mut fence = RangeFence::default();
        let a = fence.start(F, 0, 4096, 4096, 7, true);
        let b = fence.start(F, 100, 10, 4096, 7, true);
        assert!(!fence.blocked(&b));
        fence.release(&a);
        fence.release(&b);
    }

    #[test]
    fn ranges_widen_to_the_grain() {
        let mut fence = RangeFence::default();
        // A buffered edge at [5000, 5100) and another op's direct piece at [4096, 8192) share
        // the page [4096, 8192).
        let edge = fence.start(F, 5000, 100, 4096, 1, true);
        let direct = fence.start(F, 4096, 4096, 4096, 2, true);
        assert!(fence.blocked(&direct));
        let next_page = fence.start(F, 8192, 4096, 4096, 3, true);
        assert!(!fence.blocked(&next_page));
        for t in [edge, direct, next_page] {
            fence.release(&t);
        }
        assert_eq!(fence.held(), 0);
    }

    #[test]
    fn reads_hold_nothing() {
        let mut fence = RangeFence::default();
        let r = fence.start(F, 0, 100, 1, 1, false);
        let w = fence.start(F, 0, 100, 1, 2, true);
        assert!(!fence.blocked(&w), "a write never waits for a read");
        fence.release(&r);
        fence.release(&w);
        assert_eq!(fence.held(), 0);
    }

    #[test]
    fn a_long_range_far_before_is_found() {
        let mut fence = RangeFence::default();
        let long = fence.start(F, 0, 1 << 30, 1, 1, true);
        let short = fence.start(F, 0, 1, 1, 3, true);
        let late = fence.start(F, (1 << 30) - 1, 1, 1, 2, false);
        assert!(fence.blocked(&late), "found through `longest`");
        for t in [long, short, late] {
            fence.release(&t);
        }
    }

    #[test]
    fn ranges_at_the_end_of_the_offset_space_do_not_overflow() {
        let mut fence = RangeFence::default();
        let t = fence.start(F, u64::MAX - 10, 100, 4096, 1, true);
        assert_eq!(t.end, u64::MAX);
        fence.release(&t);
    }
}
