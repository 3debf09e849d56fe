//! The checksum the examples compute on the GPU and verify on the CPU: every byte weighted by
//! its position in the file, `sum(b[p] * (p % 251 + 1))`, so a byte read from the wrong
//! offset (or twice, or not at all) changes the result.

/// CUDA source of `weighted_sum(data, n, base, out)`: adds the checksum of `n` bytes that
/// start at file position `base` into `*out`.
pub const KERNEL: &str = r#"
extern "C" __global__ void weighted_sum(const unsigned char* d, unsigned long long n,
                                        unsigned long long base, unsigned long long* out) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long s = 0;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        s += d[i] * ((base + i) % 251 + 1);
    atomicAdd(out, s);
}
"#;

/// The kernel's result, on the CPU, for `data` starting at file position `base`.
pub fn weighted_sum(data: &[u8], base: u64) -> u64 {
    data.iter()
        .zip(base..)
        .map(|(&b, p)| b as u64 * (p % 251 + 1))
        .sum()
}

/// Checksums of any byte range of a file in O(range % STRIDE) time, from prefix sums kept
/// every `STRIDE` bytes: the service example verifies thousands of responses with it.
#[allow(dead_code)] // used by some of the examples that include this file
pub struct PrefixChecksum {
    data: Vec<u8>,
    prefix: Vec<u64>,
}

#[allow(dead_code)]
impl PrefixChecksum {
    const STRIDE: usize = 4096;

    /// Prefix sums over `data` (the whole file).
    pub fn new(data: Vec<u8>) -> Self {
        let mut prefix = Vec::with_capacity(data.len() / Self::STRIDE + 1);
        let mut acc = 0u64;
        prefix.push(0);
        for (i, block) in data.chunks(Self::STRIDE).enumerate() {
            acc = acc.wrapping_add(weighted_sum(block, (i * Self::STRIDE) as u64));
            prefix.push(acc);
        }
        PrefixChecksum { data, prefix }
    }

    /// File length.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// `weighted_sum` of `data[start..end]`.
    pub fn range(&self, start: usize, end: usize) -> u64 {
        let upto = |pos: usize| {
            let whole = pos / Self::STRIDE;
            let from = whole * Self::STRIDE;
            self.prefix[whole].wrapping_add(weighted_sum(&self.data[from..pos], from as u64))
        };
        upto(end).wrapping_sub(upto(start))
    }
}
