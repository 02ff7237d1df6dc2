//! Validated descriptor chains: every buffer checked against guest memory before a device
//! touches it, so device code never sees a loop, an out-of-range address or a truncated chain.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend as _};

use super::GuestMemory;
use virtio_queue::DescriptorChain;

/// One guest buffer of a chain (already checked to lie inside guest memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buf {
    /// Guest physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// Why a chain was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The chain ended early: a `next` index out of range, a loop or a chain longer than the
    /// queue (the walk is bounded by the queue size), an unreadable descriptor, a bad indirect
    /// table, or a total length above 4 GiB.
    #[error("descriptor chain is malformed (loop, bad index, too long or unreadable)")]
    Malformed,
    /// A buffer does not lie entirely inside guest memory.
    #[error("descriptor buffer {addr:#x}+{len:#x} is outside guest memory")]
    OutOfRange {
        /// Buffer address.
        addr: u64,
        /// Buffer length.
        len: u32,
    },
    /// A device-readable buffer follows a device-writable one (virtio 2.7.4.2).
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
}

/// A validated chain: its head index (for the used ring) and its buffers, split by direction.
#[derive(Debug, Clone)]
pub struct Chain {
    /// Head descriptor index, to pass to `add_used`.
    pub head: u16,
    /// Device-readable buffers, in order.
    pub readable: Vec<Buf>,
    /// Device-writable buffers, in order.
    pub writable: Vec<Buf>,
}

impl Chain {
    /// Walks `dc` and validates it.
    pub(crate) fn parse(
        dc: DescriptorChain<&GuestMemory>,
        mem: &GuestMemory,
    ) -> Result<Chain, ChainError> {
        let head = dc.head_index();
        let mut chain = Chain {
            head,
            readable: Vec::new(),
            writable: Vec::new(),
        };
        let mut last_has_next = true;
        for desc in dc {
            last_has_next = desc.has_next();
            let buf = Buf {
                addr: desc.addr(),
                len: desc.len(),
            };
            if buf.len > 0 && !mem.check_range(buf.addr, buf.len as usize) {
                return Err(ChainError::OutOfRange {
                    addr: buf.addr.0,
                    len: buf.len,
                });
            }
            if desc.is_write_only() {
                chain.writable.push(buf);
            } else if !chain.writable.is_empty() {
                return Err(ChainError::ReadableAfterWritable);
            } else {
                chain.readable.push(buf);
            }
        }
        // The iterator stops silently on every kind of corruption; the tell is that the last
        // descriptor it gave still points to a next one (or that it gave none at all).
        if last_has_next {
            return Err(ChainError::Malformed);
        }
        Ok(chain)
    }

    /// Total length of the readable buffers.
    pub fn readable_len(&self) -> u64 {
        self.readable.iter().map(|b| u64::from(b.len)).sum()
    }

    /// Total length of the writable buffers.
    pub fn writable_len(&self) -> u64 {
        self.writable.iter().map(|b| u64::from(b.len)).sum()
    }
}

/// Sequential access to a list of guest buffers as one byte stream.
#[derive(Debug, Clone)]
pub struct ChainCursor<'a> {
    bufs: &'a [Buf],
    idx: usize,
    off: u32,
}

impl<'a> ChainCursor<'a> {
    /// A cursor at the start of `bufs`.
    pub fn new(bufs: &'a [Buf]) -> Self {
        ChainCursor {
            bufs,
            idx: 0,
            off: 0,
        }
    }

    /// Bytes left from the cursor to the end of the buffers.
    pub fn remaining(&self) -> u64 {
        let mut n: u64 = 0;
        for (i, b) in self.bufs.iter().enumerate().skip(self.idx) {
            n += u64::from(b.len)
                - if i == self.idx {
                    u64::from(self.off)
                } else {
                    0
                };
        }
        n
    }

    /// Walks the cursor over up to `len` bytes, calling `f(addr, n)` for each contiguous piece.
    fn walk(
        &mut self,
        mut len: usize,
        mut f: impl FnMut(GuestAddress, usize, usize) -> Result<(), vm_memory::GuestMemoryError>,
    ) -> Result<usize, vm_memory::GuestMemoryError> {
        let mut done = 0;
        while len > 0 && self.idx < self.bufs.len() {
            let b = self.bufs[self.idx];
            let avail = (b.len - self.off) as usize;
            if avail == 0 {
                self.idx += 1;
                self.off = 0;
                continue;
            }
            let n = avail.min(len);
            f(GuestAddress(b.addr.0 + u64::from(self.off)), done, n)?;
            done += n;
            len -= n;
            self.off += n as u32;
            if self.off == b.len {
                self.idx += 1;
                self.off = 0;
            }
        }
        Ok(done)
    }

    /// Copies guest bytes into `out`; returns how many were available.
    pub fn read(
        &mut self,
        mem: &GuestMemory,
        out: &mut [u8],
    ) -> Result<usize, vm_memory::GuestMemoryError> {
        let len = out.len();
        self.walk(len, |addr, at, n| {
            mem.read_slice(&mut out[at..at + n], addr)
        })
    }

    /// Copies `data` into guest buffers; returns how many bytes fit.
    pub fn write(
        &mut self,
        mem: &GuestMemory,
        data: &[u8],
    ) -> Result<usize, vm_memory::GuestMemoryError> {
        self.walk(data.len(), |addr, at, n| {
            mem.write_slice(&data[at..at + n], addr)
        })
    }

    /// Skips `len` bytes; returns how many were there.
    pub fn skip(&mut self, len: usize) -> usize {
        self.walk(len, |_, _, _| Ok(())).unwrap_or(0)
    }
}
