//! Hostile-guest session decoder shared by the cargo-fuzz target (`fuzz/`) and by ordinary
//! `cargo test` (which replays [`seeds`]): arbitrary bytes become a sequence of guest actions
//! (register writes, guest memory writes, descriptor/avail ring edits, notifications, backend
//! input, snapshot/restore) against one virtio-mmio device. The session must never panic, hang
//! or let the device write outside what it may: [`run`] asserts that a block device never
//! changes its disk size and that a read-only disk's contents never change.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::bus::BusDevice;
use super::irq::IrqLine;
use super::virtio::{Block, GuestMemory, MmioTransport, Net, VirtioDevice, Vsock};

const MEM_LO: usize = 1 << 20;
/// A second region after a hole, so "just past the end" addresses hit unmapped space.
const MEM_HI_BASE: u64 = 2 << 20;
const MEM_HI: usize = 64 << 10;
const DISK_LEN: u64 = 64 << 10;
const MAX_OPS: usize = 256;

/// Actions of the session; the first byte of an op selects one (modulo the count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// `off: u16, val: u32` — 32-bit register write.
    RegWrite = 0,
    /// `off: u16, len: u8, bytes` — write of any width anywhere in the window.
    RawWrite,
    /// `off: u16, len: u8` — read of any width.
    RawRead,
    /// `addr: u32, len: u8, bytes` — guest memory write.
    MemWrite,
    /// `qsize_log2: u8` — full driver init with the standard ring layout.
    Init,
    /// `q: u8, idx: u8, addr: u64, len: u32, flags: u16, next: u16` — descriptor write.
    Desc,
    /// `q: u8, head: u16` — publish a head in the avail ring.
    Publish,
    /// `q: u8, idx: u16` — set the avail index to anything.
    AvailIdx,
    /// `q: u32` — QueueNotify.
    Notify,
    /// Backend processing (the VMM event loop's call).
    Backend,
    /// `len: u16, bytes` — backend input (net frame / vsock host connection bytes).
    Inject,
    /// Snapshot, serialize, restore onto a new backend.
    SnapshotRestore,
    /// Device reset (status 0).
    Reset,
}

const OPS: u8 = 13;

/// What a session did (for tests to check that seeds reach deep code).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Device kind used (0 block rw, 1 block ro, 2 net, 3 vsock).
    pub device: u8,
    /// Ops executed.
    pub ops: usize,
    /// Device ended up in DEVICE_NEEDS_RESET.
    pub needs_reset: bool,
    /// Status register at the end.
    pub status: u32,
    /// Used-ring index of each queue of the standard layout at the end.
    pub used_idx: Vec<u16>,
    /// Snapshots taken and restored.
    pub restores: usize,
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        if self.0.len() < N {
            return None;
        }
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        a.try_into().ok()
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    fn bytes(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
}

fn queue_base(q: u8) -> u64 {
    0x10000 * (u64::from(q) + 1)
}

enum Dut {
    Block {
        t: MmioTransport<Block>,
        disk: File,
        ro: bool,
        original: Vec<u8>,
    },
    Net {
        t: MmioTransport<Net>,
        host: OwnedFd,
    },
    Vsock {
        t: MmioTransport<Vsock>,
        dir: PathBuf,
        path: PathBuf,
        hosts: Vec<UnixStream>,
        gen: u32,
    },
}

fn memfd_disk() -> File {
    // SAFETY: memfd_create with a valid C string; the fd is owned by the File.
    let fd = unsafe { libc::memfd_create(c"cube-fuzz-disk".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create failed");
    // SAFETY: fd is fresh and owned by nobody else.
    let mut f = unsafe { File::from_raw_fd(fd) };
    let pattern: Vec<u8> = (0..DISK_LEN).map(|i| (i % 251) as u8).collect();
    f.write_all(&pattern).expect("memfd write");
    f
}

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two fds into the array.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "socketpair failed");
    // SAFETY: both fds are fresh.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

fn unique_dir() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "cube-vsock-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

impl Dut {
    fn bus(&mut self) -> &mut dyn BusDevice {
        match self {
            Dut::Block { t, .. } => t,
            Dut::Net { t, .. } => t,
            Dut::Vsock { t, .. } => t,
        }
    }

    fn status(&self) -> (u32, bool) {
        match self {
            Dut::Block { t, .. } => (t.status(), t.needs_reset()),
            Dut::Net { t, .. } => (t.status(), t.needs_reset()),
            Dut::Vsock { t, .. } => (t.status(), t.needs_reset()),
        }
    }

    fn nqueues(&self) -> u8 {
        match self {
            Dut::Block { t, .. } => t.device().queue_max_sizes().len() as u8,
            Dut::Net { t, .. } => t.device().queue_max_sizes().len() as u8,
            Dut::Vsock { t, .. } => t.device().queue_max_sizes().len() as u8,
        }
    }

    fn process_backend(&mut self) {
        match self {
            Dut::Block { t, .. } => t.process_backend(),
            Dut::Net { t, .. } => t.process_backend(),
            Dut::Vsock { t, .. } => t.process_backend(),
        }
    }

    fn inject(&mut self, data: &[u8]) {
        match self {
            Dut::Block { .. } => {}
            Dut::Net { host, .. } => {
                // SAFETY: valid buffer; a full socket just drops the frame.
                unsafe {
                    libc::send(
                        host.as_raw_fd(),
                        data.as_ptr().cast(),
                        data.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
            }
            Dut::Vsock { path, hosts, .. } => {
                if data.first().is_some_and(|b| b & 1 == 0) || hosts.is_empty() {
                    if let Ok(s) = UnixStream::connect(&*path) {
                        let _ = s.set_nonblocking(true);
                        hosts.push(s);
                    }
                }
                if let Some(s) = hosts.last_mut() {
                    let _ = s.write(data.get(1..).unwrap_or_default());
                }
            }
        }
    }

    /// Drains what the device sent to the host side, checking its shape.
    fn drain(&mut self) {
        match self {
            Dut::Net { host, .. } => {
                let mut buf = vec![0u8; 70000];
                loop {
                    // SAFETY: valid buffer.
                    let r = unsafe {
                        libc::recv(
                            host.as_raw_fd(),
                            buf.as_mut_ptr().cast(),
                            buf.len(),
                            libc::MSG_DONTWAIT,
                        )
                    };
                    if r < 0 {
                        break;
                    }
                    assert!(
                        r as usize <= super::virtio::net::MAX_FRAME,
                        "oversized frame on the tap"
                    );
                }
            }
            Dut::Vsock { hosts, .. } => {
                let mut buf = [0u8; 4096];
                for h in hosts.iter_mut() {
                    while matches!(h.read(&mut buf), Ok(n) if n > 0) {}
                }
            }
            Dut::Block { .. } => {}
        }
    }

    fn snapshot_restore(&mut self, mem: &GuestMemory) {
        let irq = IrqLine::new(5).expect("eventfd");
        match self {
            Dut::Block { t, disk, .. } => {
                let st = roundtrip(&t.state());
                let new_disk = disk.try_clone().expect("dup");
                *t = MmioTransport::restore(st, new_disk, mem.clone(), irq).expect("block restore");
            }
            Dut::Net { t, host } => {
                let st = roundtrip(&t.state());
                let (dev, h) = seqpacket_pair();
                *t = MmioTransport::restore(st, dev, mem.clone(), irq).expect("net restore");
                *host = h;
            }
            Dut::Vsock {
                t,
                dir,
                path,
                hosts,
                gen,
            } => {
                let st = roundtrip(&t.state());
                *gen += 1;
                let new_path = dir.join(format!("v{gen}.sock"));
                *t = MmioTransport::restore(st, new_path.clone(), mem.clone(), irq)
                    .expect("vsock restore");
                *path = new_path;
                hosts.clear();
            }
        }
    }
}

fn roundtrip<T: serde::Serialize + serde::de::DeserializeOwned>(v: &T) -> T {
    let s = serde_json::to_vec(v).expect("state serializes");
    serde_json::from_slice(&s).expect("state deserializes")
}

fn reg_write(d: &mut Dut, reg: u32, v: u32) {
    d.bus().write(u64::from(reg), &v.to_le_bytes());
}

fn init(d: &mut Dut, qsize: u16) {
    use virtio_bindings::virtio_mmio::*;
    reg_write(d, VIRTIO_MMIO_STATUS, 0);
    reg_write(d, VIRTIO_MMIO_STATUS, 3);
    for sel in 0..2 {
        reg_write(d, VIRTIO_MMIO_DEVICE_FEATURES_SEL, sel);
        let mut b = [0u8; 4];
        d.bus().read(u64::from(VIRTIO_MMIO_DEVICE_FEATURES), &mut b);
        reg_write(d, VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
        reg_write(d, VIRTIO_MMIO_DRIVER_FEATURES, u32::from_le_bytes(b));
    }
    reg_write(d, VIRTIO_MMIO_STATUS, 11);
    for q in 0..d.nqueues() {
        let base = queue_base(q);
        reg_write(d, VIRTIO_MMIO_QUEUE_SEL, u32::from(q));
        reg_write(d, VIRTIO_MMIO_QUEUE_NUM, u32::from(qsize));
        reg_write(d, VIRTIO_MMIO_QUEUE_DESC_LOW, base as u32);
        reg_write(d, VIRTIO_MMIO_QUEUE_AVAIL_LOW, (base + 0x2000) as u32);
        reg_write(d, VIRTIO_MMIO_QUEUE_USED_LOW, (base + 0x4000) as u32);
        reg_write(d, VIRTIO_MMIO_QUEUE_READY, 1);
    }
    reg_write(d, VIRTIO_MMIO_STATUS, 15);
}

/// Runs one hostile session described by `data`. Panics only on a real device bug.
pub fn run(data: &[u8]) -> Outcome {
    let mut inp = Input(data);
    let kind = inp.u8().unwrap_or(0) % 4;
    let mem: GuestMemory = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), MEM_LO),
        (GuestAddress(MEM_HI_BASE), MEM_HI),
    ])
    .expect("guest memory");
    let irq = IrqLine::new(5).expect("eventfd");
    let mut dut = match kind {
        0 | 1 => {
            let disk = memfd_disk();
            let ro = kind == 1;
            let dev = Block::new(disk.try_clone().expect("dup"), ro, "fuzz").expect("block");
            let mut original = Vec::new();
            let mut f = disk.try_clone().expect("dup");
            let _ = std::io::Seek::rewind(&mut f);
            f.read_to_end(&mut original).expect("read disk");
            Dut::Block {
                t: MmioTransport::new(dev, mem.clone(), irq).expect("transport"),
                disk,
                ro,
                original,
            }
        }
        2 => {
            let (dev, host) = seqpacket_pair();
            let net = Net::new(dev, [2, 0, 0, 0, 0, 1]).expect("net");
            Dut::Net {
                t: MmioTransport::new(net, mem.clone(), irq).expect("transport"),
                host,
            }
        }
        _ => {
            let dir = unique_dir();
            let path = dir.join("v0.sock");
            let vs = Vsock::new(3, &path).expect("vsock");
            Dut::Vsock {
                t: MmioTransport::new(vs, mem.clone(), irq).expect("transport"),
                dir,
                path,
                hosts: Vec::new(),
                gen: 0,
            }
        }
    };
    let mut out = Outcome {
        device: kind,
        ..Outcome::default()
    };
    // The fuzzer's own view of the avail index per queue (for Publish).
    let mut avail_idx = [0u16; 4];
    let mut qsize: u16 = 16;

    while out.ops < MAX_OPS {
        let Some(opb) = inp.u8() else { break };
        out.ops += 1;
        let ok = (|| -> Option<()> {
            match opb % OPS {
                0 => {
                    let off = inp.u16()? & 0x1fc;
                    let v = inp.u32()?;
                    dut.bus().write(u64::from(off), &v.to_le_bytes());
                }
                1 => {
                    let off = inp.u16()? & 0xfff;
                    let len = [1usize, 2, 4, 8][usize::from(inp.u8()? % 4)];
                    let b = inp.bytes(len)?.to_vec();
                    dut.bus().write(u64::from(off), &b);
                }
                2 => {
                    let off = inp.u16()? & 0xfff;
                    let len = [1usize, 2, 4, 8][usize::from(inp.u8()? % 4)];
                    let mut b = vec![0u8; len];
                    dut.bus().read(u64::from(off), &mut b);
                }
                3 => {
                    let addr = u64::from(inp.u32()?) % (MEM_HI_BASE + MEM_HI as u64 + 0x1000);
                    let len = usize::from(inp.u8()?);
                    let b = inp.bytes(len)?;
                    let _ = mem.write_slice(b, GuestAddress(addr));
                }
                4 => {
                    qsize = 1u16 << (inp.u8()? % 10);
                    init(&mut dut, qsize);
                    avail_idx = [0; 4];
                }
                5 => {
                    let q = inp.u8()? % 4;
                    let idx = u64::from(inp.u8()?);
                    let raw = inp.u64()?;
                    // Mostly addresses inside the data area, sometimes anything at all.
                    let addr = if raw & 1 == 0 {
                        0x80000 + (raw >> 1) % 0x80000
                    } else {
                        raw
                    };
                    let len = inp.u32()?;
                    let flags = inp.u16()? & 0x7;
                    let next = inp.u16()?;
                    let mut d = [0u8; 16];
                    d[0..8].copy_from_slice(&addr.to_le_bytes());
                    d[8..12].copy_from_slice(&len.to_le_bytes());
                    d[12..14].copy_from_slice(&flags.to_le_bytes());
                    d[14..16].copy_from_slice(&next.to_le_bytes());
                    let _ = mem.write_slice(&d, GuestAddress(queue_base(q) + 16 * idx));
                }
                6 => {
                    let q = inp.u8()? % 4;
                    let head = inp.u16()?;
                    let avail = queue_base(q) + 0x2000;
                    let i = &mut avail_idx[usize::from(q)];
                    let slot = avail + 4 + 2 * u64::from(*i % qsize.max(1));
                    let _ = mem.write_obj(head, GuestAddress(slot));
                    *i = i.wrapping_add(1);
                    let _ = mem.write_obj(*i, GuestAddress(avail + 2));
                }
                7 => {
                    let q = inp.u8()? % 4;
                    let idx = inp.u16()?;
                    avail_idx[usize::from(q)] = idx;
                    let _ = mem.write_obj(idx, GuestAddress(queue_base(q) + 0x2002));
                }
                8 => {
                    let q = inp.u32()?;
                    // Mostly real queues.
                    let q = if q & 0x100 == 0 { q % 4 } else { q };
                    reg_write(
                        &mut dut,
                        virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_NOTIFY,
                        q,
                    );
                }
                9 => dut.process_backend(),
                10 => {
                    let len = usize::from(inp.u16()? % 2048);
                    let b = inp.bytes(len.min(inp.0.len()))?.to_vec();
                    dut.inject(&b);
                    dut.process_backend();
                }
                11 => {
                    dut.snapshot_restore(&mem);
                    out.restores += 1;
                }
                _ => reg_write(
                    &mut dut,
                    virtio_bindings::virtio_mmio::VIRTIO_MMIO_STATUS,
                    0,
                ),
            }
            Some(())
        })();
        dut.drain();
        if ok.is_none() {
            break;
        }
    }

    let (status, needs_reset) = dut.status();
    out.status = status;
    out.needs_reset = needs_reset;
    for q in 0..dut.nqueues() {
        out.used_idx.push(
            mem.read_obj(GuestAddress(queue_base(q) + 0x4002))
                .unwrap_or(0),
        );
    }
    match &dut {
        Dut::Block {
            disk, ro, original, ..
        } => {
            let len = disk.metadata().map(|m| m.len()).unwrap_or(0);
            assert_eq!(len, DISK_LEN, "block device changed the disk size");
            if *ro {
                let mut now = Vec::new();
                let mut f = disk.try_clone().expect("dup");
                let _ = std::io::Seek::rewind(&mut f);
                f.read_to_end(&mut now).expect("read disk");
                assert!(now == *original, "read-only disk was modified");
            }
        }
        Dut::Vsock { dir, .. } => {
            let d = dir.clone();
            drop(dut);
            let _ = std::fs::remove_dir_all(d);
        }
        Dut::Net { .. } => {}
    }
    out
}

/// Builds session inputs op by op (for seeds and tests).
#[derive(Debug, Clone, Default)]
pub struct SeedBuilder(Vec<u8>);

impl SeedBuilder {
    /// A session on device kind `kind` (0 block rw, 1 block ro, 2 net, 3 vsock).
    pub fn new(kind: u8) -> Self {
        SeedBuilder(vec![kind])
    }
    fn op(mut self, op: Op, args: &[u8]) -> Self {
        self.0.push(op as u8);
        self.0.extend_from_slice(args);
        self
    }
    /// Driver init with queue size `1 << log2`.
    pub fn init(self, log2: u8) -> Self {
        self.op(Op::Init, &[log2])
    }
    /// Descriptor write.
    pub fn desc(self, q: u8, idx: u8, addr: u64, len: u32, flags: u16, next: u16) -> Self {
        let mut a = vec![q, idx];
        a.extend_from_slice(&addr.to_le_bytes());
        a.extend_from_slice(&len.to_le_bytes());
        a.extend_from_slice(&flags.to_le_bytes());
        a.extend_from_slice(&next.to_le_bytes());
        self.op(Op::Desc, &a)
    }
    /// Data-area address `off` in the encoding of [`SeedBuilder::desc`].
    pub fn data(off: u64) -> u64 {
        off << 1
    }
    /// Publish a head.
    pub fn publish(self, q: u8, head: u16) -> Self {
        let mut a = vec![q];
        a.extend_from_slice(&head.to_le_bytes());
        self.op(Op::Publish, &a)
    }
    /// Raw avail index.
    pub fn avail_idx(self, q: u8, idx: u16) -> Self {
        let mut a = vec![q];
        a.extend_from_slice(&idx.to_le_bytes());
        self.op(Op::AvailIdx, &a)
    }
    /// QueueNotify.
    pub fn notify(self, q: u32) -> Self {
        self.op(Op::Notify, &q.to_le_bytes())
    }
    /// Guest memory write.
    pub fn mem(self, addr: u32, data: &[u8]) -> Self {
        let mut a = addr.to_le_bytes().to_vec();
        a.push(data.len() as u8);
        a.extend_from_slice(data);
        self.op(Op::MemWrite, &a)
    }
    /// 32-bit register write.
    pub fn reg(self, off: u16, v: u32) -> Self {
        let mut a = off.to_le_bytes().to_vec();
        a.extend_from_slice(&v.to_le_bytes());
        self.op(Op::RegWrite, &a)
    }
    /// Backend input.
    pub fn inject(self, data: &[u8]) -> Self {
        let mut a = (data.len() as u16).to_le_bytes().to_vec();
        a.extend_from_slice(data);
        self.op(Op::Inject, &a)
    }
    /// Backend processing.
    pub fn backend(self) -> Self {
        self.op(Op::Backend, &[])
    }
    /// Snapshot + restore.
    pub fn snapshot(self) -> Self {
        self.op(Op::SnapshotRestore, &[])
    }
    /// Device reset.
    pub fn reset(self) -> Self {
        self.op(Op::Reset, &[])
    }
    /// The encoded session.
    pub fn build(self) -> Vec<u8> {
        self.0
    }
}

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

/// Fixed hostile sessions: descriptor loops, out-of-range addresses, huge lengths, chains
/// longer than the queue, bad queue sizes, runaway avail indices, writes to a read-only disk,
/// bogus indirect tables, snapshot/restore with requests in flight.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let d = SeedBuilder::data;
    // A block header at data+0: type OUT (1), sector 2.
    let out_hdr: Vec<u8> = [1u32.to_le_bytes().as_slice(), &[0; 4], &2u64.to_le_bytes()].concat();
    let in_hdr: Vec<u8> = [0u32.to_le_bytes().as_slice(), &[0; 4], &1u64.to_le_bytes()].concat();
    let block_req = |kind: u8, hdr: &[u8], data_flags: u16| {
        SeedBuilder::new(kind)
            .init(4)
            .mem(0x80000, hdr)
            .desc(0, 0, d(0), 16, F_NEXT, 1)
            .desc(0, 1, d(0x1000), 512, F_NEXT | data_flags, 2)
            .desc(0, 2, d(0x2000), 1, F_WRITE, 0)
            .publish(0, 0)
            .notify(0)
    };
    vec![
        ("block good read", block_req(0, &in_hdr, F_WRITE).build()),
        ("block good write", block_req(0, &out_hdr, 0).build()),
        ("read-only disk write", block_req(1, &out_hdr, 0).build()),
        (
            "descriptor loop",
            SeedBuilder::new(0)
                .init(4)
                .mem(0x80000, &in_hdr)
                .desc(0, 0, d(0), 16, F_NEXT, 1)
                .desc(0, 1, d(0x1000), 512, F_NEXT | F_WRITE, 0)
                .publish(0, 0)
                .notify(0)
                .build(),
        ),
        (
            "out-of-range and huge buffers",
            SeedBuilder::new(0)
                .init(4)
                .mem(0x80000, &in_hdr)
                .desc(0, 0, d(0), 16, F_NEXT, 1)
                .desc(
                    0,
                    1,
                    0x0000_7fff_ffff_f001,
                    0xffff_ffff,
                    F_NEXT | F_WRITE,
                    2,
                )
                .desc(0, 2, (MEM_LO as u64 - 4) << 1, 64, F_WRITE, 0)
                .publish(0, 0)
                .desc(0, 3, d(0), 16, F_NEXT, 4)
                .desc(0, 4, d(0x1000), 0xffff_0000, F_WRITE, 0)
                .publish(0, 3)
                .notify(0)
                .build(),
        ),
        (
            "chain longer than queue",
            (0..16u8)
                .fold(SeedBuilder::new(0).init(4), |s, i| {
                    s.desc(0, i, d(0), 16, F_NEXT, u16::from((i + 1) % 16))
                })
                .publish(0, 0)
                .notify(0)
                .build(),
        ),
        (
            "bogus indirect table",
            SeedBuilder::new(0)
                .init(4)
                .desc(0, 0, d(0x100), 0x10_0000, F_INDIRECT, 0)
                .desc(0, 1, d(0x100), 13, F_INDIRECT | F_NEXT, 0)
                .publish(0, 0)
                .publish(0, 1)
                .notify(0)
                .build(),
        ),
        (
            "bad queue size",
            SeedBuilder::new(0).init(9).notify(0).build(),
        ),
        (
            "runaway avail index then reset",
            SeedBuilder::new(2)
                .init(4)
                .avail_idx(1, 0x8000)
                .notify(1)
                .reset()
                .init(4)
                .avail_idx(1, 0)
                .notify(1)
                .build(),
        ),
        (
            "head index out of range",
            SeedBuilder::new(0)
                .init(4)
                .publish(0, 999)
                .notify(0)
                .build(),
        ),
        (
            "notify unknown queues and before init",
            SeedBuilder::new(3)
                .notify(7)
                .notify(0xffff_ffff)
                .init(3)
                .notify(5)
                .notify(0x1_0000)
                .build(),
        ),
        (
            "register garbage",
            SeedBuilder::new(2)
                .reg(0x70, 0xffff_ffff)
                .reg(0x38, 0xffff_ffff)
                .reg(0x30, 0xffff_ffff)
                .reg(0x44, 1)
                .reg(0x80, 0xffff_fff0)
                .reg(0x70, 0)
                .build(),
        ),
        (
            "net frames both ways + snapshot",
            SeedBuilder::new(2)
                .init(4)
                .desc(0, 0, d(0x4000), 2048, F_WRITE, 0)
                .publish(0, 0)
                .desc(1, 0, d(0x1000), 12, F_NEXT, 1)
                .desc(1, 1, d(0x2000), 60, 0, 0)
                .publish(1, 0)
                .snapshot()
                .notify(1)
                .inject(&[0xab; 60])
                .inject(&[0xcd; 1500])
                .backend()
                .build(),
        ),
        (
            "vsock connect with hostile packets",
            SeedBuilder::new(3)
                .init(4)
                .desc(0, 0, d(0x4000), 4096, F_WRITE, 0)
                .publish(0, 0)
                .inject(b"\x00CONNECT 80\n")
                .mem(0x81000, &[0xff; 44])
                .desc(1, 0, d(0x1000), 44, 0, 0)
                .publish(1, 0)
                .notify(1)
                .snapshot()
                .inject(b"\x00CONNECT 81\nhello")
                .build(),
        ),
        (
            "block snapshot mid-flight",
            block_req(0, &out_hdr, 0)
                .publish(0, 0)
                .snapshot()
                .notify(0)
                .build(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_seeds_run_clean() {
        for (name, seed) in seeds() {
            let out = run(&seed);
            eprintln!("{name}: {out:?}");
            assert!(out.ops > 0, "{name}");
            match name {
                "block good read" | "block good write" | "read-only disk write" => {
                    assert_eq!(out.used_idx, vec![1], "{name}");
                    assert!(!out.needs_reset, "{name}");
                }
                "descriptor loop" | "chain longer than queue" => {
                    assert_eq!(out.used_idx, vec![1], "{name}: completed with an error");
                    assert!(!out.needs_reset, "{name}");
                }
                "out-of-range and huge buffers" | "bogus indirect table" => {
                    assert_eq!(out.used_idx, vec![2], "{name}");
                }
                "bad queue size" | "head index out of range" => assert!(out.needs_reset, "{name}"),
                "runaway avail index then reset" => {
                    assert!(!out.needs_reset, "{name}: reset clears it")
                }
                "net frames both ways + snapshot" => {
                    assert_eq!(out.restores, 1);
                    assert_eq!(out.used_idx, vec![1, 1], "{name}");
                }
                "block snapshot mid-flight" => assert_eq!(out.used_idx, vec![2], "{name}"),
                _ => {}
            }
        }
    }

    /// With `CUBE_FUZZ_SEED_DIR=fuzz/corpus/virtio_mmio` set, writes the seeds there as the
    /// fuzzer's starting corpus; otherwise does nothing.
    #[test]
    fn write_seed_corpus_when_asked() {
        if let Ok(dir) = std::env::var("CUBE_FUZZ_SEED_DIR") {
            std::fs::create_dir_all(&dir).unwrap();
            for (i, (_, seed)) in seeds().into_iter().enumerate() {
                std::fs::write(format!("{dir}/seed-{i:02}"), seed).unwrap();
            }
        }
    }

    #[test]
    fn truncated_and_random_inputs_do_not_panic() {
        // Every prefix of every seed, plus a deterministic pseudo-random stream.
        for (_, seed) in seeds() {
            for n in (0..seed.len()).step_by(7) {
                run(&seed[..n]);
            }
        }
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..40 {
            let mut v = Vec::with_capacity(600);
            for _ in 0..600 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                v.push(x as u8);
            }
            run(&v);
        }
    }
}
