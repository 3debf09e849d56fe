//! The byte format of what agents hand each other (metadata, descriptor lists, messages):
//! little-endian integers and length-prefixed byte strings behind a magic and a version, read
//! back with every length checked. Hand-written because it is a dozen fields and the
//! decoder's errors must name what is wrong; no serde format crate is in the dependency tree.

/// Appends fields to a byte buffer.
#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    /// A buffer starting with `magic` and `version`.
    pub(crate) fn new(magic: &[u8; 8], version: u16) -> Writer {
        let mut w = Writer::default();
        w.buf.extend_from_slice(magic);
        w.u16(version);
        w
    }
    pub(crate) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.buf.extend_from_slice(b);
    }
    pub(crate) fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
}

/// Reads fields back; every error says which field and why.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Checks `magic` and returns the reader and the version found.
    pub(crate) fn new(
        buf: &'a [u8],
        magic: &[u8; 8],
        what: &'static str,
    ) -> Result<(Reader<'a>, u16), String> {
        if buf.len() < 10 || &buf[..8] != magic {
            return Err(format!(
                "not gpuio {what} ({} bytes that do not start with {:?})",
                buf.len(),
                String::from_utf8_lossy(magic)
            ));
        }
        let mut r = Reader {
            buf: &buf[8..],
            what,
        };
        let v = r.u16("version")?;
        Ok((r, v))
    }
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "truncated {}: {field} needs {n} bytes, {} left",
                self.what,
                self.buf.len()
            ));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self, field: &str) -> Result<u8, String> {
        Ok(self.take(1, field)?[0])
    }
    pub(crate) fn u16(&mut self, field: &str) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2, field)?.try_into().unwrap_or_default(),
        ))
    }
    pub(crate) fn u32(&mut self, field: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4, field)?.try_into().unwrap_or_default(),
        ))
    }
    pub(crate) fn u64(&mut self, field: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8, field)?.try_into().unwrap_or_default(),
        ))
    }
    pub(crate) fn bytes(&mut self, field: &str) -> Result<&'a [u8], String> {
        let n = self.u64(field)?;
        let n = usize::try_from(n).map_err(|_| format!("{field}: length {n} too large"))?;
        self.take(n, field)
    }
    pub(crate) fn str(&mut self, field: &str) -> Result<String, String> {
        let b = self.bytes(field)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{}: {field} is not UTF-8", self.what))
    }
    /// A count of items each at least `min_item` bytes long, checked against what is left
    /// (so a corrupt count cannot make the caller reserve gigabytes).
    pub(crate) fn count(&mut self, field: &str, min_item: usize) -> Result<usize, String> {
        let n = self.u64(field)?;
        if n.saturating_mul(min_item.max(1) as u64) > self.buf.len() as u64 {
            return Err(format!(
                "truncated {}: {n} {field} cannot fit in {} bytes",
                self.what,
                self.buf.len()
            ));
        }
        Ok(n as usize)
    }
    /// Errors unless everything was read.
    pub(crate) fn finish(self) -> Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} has {} bytes past its end",
                self.what,
                self.buf.len()
            ))
        }
    }
}
