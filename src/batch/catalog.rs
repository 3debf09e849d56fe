//! Named extents: a catalog from names to ranges of files, and from kinds to arrays of
//! fixed-size records ("read kind / index / count"), read into host or device memory.

use std::collections::HashMap;

use super::{BatchPlan, ReadDesc};
use crate::buf::ReadDst;
use crate::error::{Context, Error, OpKind, Result};
use crate::file::File;
use crate::plan::MAX_POS;

/// `len` bytes of `file` at `offset`.
#[derive(Debug, Clone)]
pub struct Extent {
    /// The file.
    pub file: File,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
}

impl Extent {
    /// `len` bytes of `file` at `offset`.
    pub fn new(file: &File, offset: u64, len: usize) -> Self {
        Extent {
            file: file.clone(),
            offset,
            len,
        }
    }
}

/// `count` records of `record_len` bytes each, stored back to back in `file` from `offset`:
/// record `i` is at `offset + i * record_len` (KV-cache pages, fixed-size rows).
#[derive(Debug, Clone)]
pub struct RecordKind {
    /// The file.
    pub file: File,
    /// Byte offset of record 0.
    pub offset: u64,
    /// Bytes per record.
    pub record_len: usize,
    /// Records.
    pub count: u64,
}

/// Names to extents, kinds to record arrays.
#[derive(Debug, Default, Clone)]
pub struct Catalog {
    extents: HashMap<String, Extent>,
    kinds: HashMap<String, RecordKind>,
}

impl Catalog {
    /// An empty catalog.
    pub fn new() -> Self {
        Catalog::default()
    }

    /// Adds (or replaces) `name`; returns the extent it replaced.
    pub fn insert(&mut self, name: impl Into<String>, extent: Extent) -> Result<Option<Extent>> {
        let name = name.into();
        if extent
            .offset
            .checked_add(extent.len as u64)
            .is_none_or(|e| e > MAX_POS)
        {
            return Err(Error::invalid(
                extent.file.ctx(OpKind::Read, extent.offset),
                format!(
                    "extent {name:?}: offset {} + length {} passes the largest file offset",
                    extent.offset, extent.len
                ),
            ));
        }
        Ok(self.extents.insert(name, extent))
    }

    /// Adds (or replaces) the record kind `kind`; returns the one it replaced.
    pub fn insert_kind(
        &mut self,
        kind: impl Into<String>,
        records: RecordKind,
    ) -> Result<Option<RecordKind>> {
        let kind = kind.into();
        let end = (records.record_len as u64)
            .checked_mul(records.count)
            .and_then(|b| b.checked_add(records.offset));
        if records.record_len == 0 || end.is_none_or(|e| e > MAX_POS) {
            return Err(Error::invalid(
                records.file.ctx(OpKind::Read, records.offset),
                format!(
                    "kind {kind:?}: {} records of {} bytes from offset {} do not fit a file",
                    records.count, records.record_len, records.offset
                ),
            ));
        }
        Ok(self.kinds.insert(kind, records))
    }

    /// The extent called `name`.
    pub fn get(&self, name: &str) -> Option<&Extent> {
        self.extents.get(name)
    }

    /// The record kind `kind`.
    pub fn kind(&self, kind: &str) -> Option<&RecordKind> {
        self.kinds.get(kind)
    }

    /// Extent names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.extents.keys().map(String::as_str)
    }

    /// Reads extent `name` into `dst`, whose length must equal the extent's. Returns the bytes
    /// read (short only where the file ends inside the extent).
    pub async fn read<D: ReadDst + ?Sized>(&self, name: &str, dst: &mut D) -> Result<usize> {
        let e = self.extent(name)?;
        let have = dst.target().len();
        if have != e.len {
            return Err(Error::invalid(
                e.file.ctx(OpKind::Read, e.offset),
                format!(
                    "extent {name:?} has {} bytes but the destination holds {have}",
                    e.len
                ),
            ));
        }
        e.file.read_into(dst, e.offset).await
    }

    /// Reads `count` records of `kind` from record `index` on into `dst`, whose length must be
    /// `count * record_len`.
    pub async fn read_records<D: ReadDst + ?Sized>(
        &self,
        kind: &str,
        index: u64,
        count: u64,
        dst: &mut D,
    ) -> Result<usize> {
        let k = self.record_kind(kind)?;
        self.check_records(kind, k, index, count)?;
        let want = k.record_len as u64 * count;
        let have = dst.target().len() as u64;
        if have != want {
            return Err(Error::invalid(
                k.file.ctx(OpKind::Read, k.offset),
                format!(
                    "{count} records of {kind:?} are {want} bytes but the destination holds {have}"
                ),
            ));
        }
        let offset = k.offset + index * k.record_len as u64;
        k.file.read_into(dst, offset).await
    }

    /// A plan reading the named extents packed back to back, in the order given, into one
    /// destination of [`BatchPlan::dst_len`] bytes. Unknown names are an error.
    pub fn plan(&self, names: &[&str]) -> Result<BatchPlan> {
        let mut at = 0usize;
        let mut descs = Vec::with_capacity(names.len());
        for name in names {
            let e = self.extent(name)?;
            descs.push(ReadDesc::new(&e.file, e.offset, e.len, at));
            at = at.checked_add(e.len).ok_or_else(|| {
                Error::invalid(
                    Context::op(OpKind::Read),
                    "the extents' total length overflows",
                )
            })?;
        }
        Ok(BatchPlan::new(descs))
    }

    /// A plan reading records `indices` of `kind`, packed in the order given (record
    /// `indices[i]` lands at `i * record_len`). Neighbouring indices merge into one read.
    pub fn plan_records(&self, kind: &str, indices: &[u64]) -> Result<BatchPlan> {
        let k = self.record_kind(kind)?;
        let mut descs = Vec::with_capacity(indices.len());
        for (i, &index) in indices.iter().enumerate() {
            self.check_records(kind, k, index, 1)?;
            descs.push(ReadDesc::new(
                &k.file,
                k.offset + index * k.record_len as u64,
                k.record_len,
                i * k.record_len,
            ));
        }
        Ok(BatchPlan::new(descs))
    }

    fn extent(&self, name: &str) -> Result<&Extent> {
        self.extents.get(name).ok_or_else(|| {
            Error::invalid(
                Context::op(OpKind::Read),
                format!("no extent named {name:?} in the catalog"),
            )
        })
    }

    fn record_kind(&self, kind: &str) -> Result<&RecordKind> {
        self.kinds.get(kind).ok_or_else(|| {
            Error::invalid(
                Context::op(OpKind::Read),
                format!("no record kind {kind:?} in the catalog"),
            )
        })
    }

    fn check_records(&self, kind: &str, k: &RecordKind, index: u64, count: u64) -> Result<()> {
        if index.checked_add(count).is_none_or(|end| end > k.count) {
            return Err(Error::invalid(
                k.file.ctx(OpKind::Read, k.offset),
                format!(
                    "records {index}..{} of {kind:?} are past its {} records",
                    index.saturating_add(count),
                    k.count
                ),
            ));
        }
        Ok(())
    }
}
