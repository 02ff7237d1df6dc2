//! A host-side stand-in for a guest virtio driver: lays out split queues in guest memory and
//! pokes the transport registers through `BusDevice`, so device tests see what a guest does.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{GuestMemory, MmioTransport, VirtioDevice};
use crate::devices::bus::BusDevice;
use virtio_bindings::virtio_mmio::*;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

pub fn memory(size: usize) -> GuestMemory {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap()
}

/// Where queue `q`'s rings live (64 KiB apart from 0x10000).
pub fn queue_base(q: u16) -> u64 {
    0x10000 * (u64::from(q) + 1)
}

#[derive(Debug, Clone)]
pub struct DrvQueue {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

pub struct Driver {
    pub mem: GuestMemory,
    pub queues: Vec<DrvQueue>,
    heap: u64,
}

pub fn wr32<D: VirtioDevice>(t: &mut MmioTransport<D>, reg: u32, v: u32) {
    t.write(u64::from(reg), &v.to_le_bytes());
}

pub fn rd32<D: VirtioDevice>(t: &mut MmioTransport<D>, reg: u32) -> u32 {
    let mut b = [0u8; 4];
    t.read(u64::from(reg), &mut b);
    u32::from_le_bytes(b)
}

impl Driver {
    pub fn new(mem: GuestMemory) -> Self {
        Driver {
            mem,
            queues: Vec::new(),
            heap: 0x100000,
        }
    }

    /// Full init: features = everything offered, queues of `qsize`, DRIVER_OK.
    pub fn init<D: VirtioDevice>(&mut self, t: &mut MmioTransport<D>, nqueues: u16, qsize: u16) {
        assert_eq!(rd32(t, VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
        assert_eq!(rd32(t, VIRTIO_MMIO_VERSION), 2);
        wr32(t, VIRTIO_MMIO_STATUS, 0);
        wr32(t, VIRTIO_MMIO_STATUS, 1);
        wr32(t, VIRTIO_MMIO_STATUS, 1 | 2);
        wr32(t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
        let lo = rd32(t, VIRTIO_MMIO_DEVICE_FEATURES);
        wr32(t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        let hi = rd32(t, VIRTIO_MMIO_DEVICE_FEATURES);
        wr32(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        wr32(t, VIRTIO_MMIO_DRIVER_FEATURES, lo);
        wr32(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr32(t, VIRTIO_MMIO_DRIVER_FEATURES, hi);
        wr32(t, VIRTIO_MMIO_STATUS, 1 | 2 | 8);
        assert_eq!(rd32(t, VIRTIO_MMIO_STATUS) & 8, 8, "FEATURES_OK accepted");
        self.queues.clear();
        for q in 0..nqueues {
            let base = queue_base(q);
            let dq = DrvQueue {
                size: qsize,
                desc: base,
                avail: base + 0x2000,
                used: base + 0x4000,
                next_desc: 0,
                avail_idx: 0,
                used_seen: 0,
            };
            wr32(t, VIRTIO_MMIO_QUEUE_SEL, u32::from(q));
            assert!(rd32(t, VIRTIO_MMIO_QUEUE_NUM_MAX) >= u32::from(qsize));
            wr32(t, VIRTIO_MMIO_QUEUE_NUM, u32::from(qsize));
            wr32(t, VIRTIO_MMIO_QUEUE_DESC_LOW, dq.desc as u32);
            wr32(t, VIRTIO_MMIO_QUEUE_DESC_HIGH, 0);
            wr32(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, dq.avail as u32);
            wr32(t, VIRTIO_MMIO_QUEUE_AVAIL_HIGH, 0);
            wr32(t, VIRTIO_MMIO_QUEUE_USED_LOW, dq.used as u32);
            wr32(t, VIRTIO_MMIO_QUEUE_USED_HIGH, 0);
            wr32(t, VIRTIO_MMIO_QUEUE_READY, 1);
            self.queues.push(dq);
        }
        wr32(t, VIRTIO_MMIO_STATUS, 1 | 2 | 8 | 4);
        assert_eq!(rd32(t, VIRTIO_MMIO_STATUS), 15);
    }

    /// Allocates `len` bytes of guest memory (zeroed) for buffers.
    pub fn alloc(&mut self, len: u64) -> u64 {
        let a = self.heap;
        self.heap += (len + 15) & !15;
        self.mem
            .write_slice(&vec![0u8; len as usize], GuestAddress(a))
            .unwrap();
        a
    }

    pub fn write_desc(&self, q: u16, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.queues[q as usize].desc + 16 * u64::from(idx);
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem.write_slice(&b, GuestAddress(d)).unwrap();
    }

    /// Publishes `head` in the avail ring.
    pub fn publish(&mut self, q: u16, head: u16) {
        let dq = &mut self.queues[q as usize];
        let slot = dq.avail + 4 + 2 * u64::from(dq.avail_idx % dq.size);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        dq.avail_idx = dq.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(dq.avail_idx, GuestAddress(dq.avail + 2))
            .unwrap();
    }

    /// Adds a chain of (addr, len, device-writable) buffers; returns its head.
    pub fn add_chain(&mut self, q: u16, bufs: &[(u64, u32, bool)]) -> u16 {
        let size = self.queues[q as usize].size;
        let head = self.queues[q as usize].next_desc;
        for (i, &(addr, len, w)) in bufs.iter().enumerate() {
            let idx = (head + i as u16) % size;
            let last = i + 1 == bufs.len();
            let flags = if w { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT };
            self.write_desc(q, idx, addr, len, flags, (idx + 1) % size);
        }
        self.queues[q as usize].next_desc = (head + bufs.len() as u16) % size;
        self.publish(q, head);
        head
    }

    pub fn notify<D: VirtioDevice>(&self, t: &mut MmioTransport<D>, q: u16) {
        wr32(t, VIRTIO_MMIO_QUEUE_NOTIFY, u32::from(q));
    }

    pub fn used_idx(&self, q: u16) -> u16 {
        self.mem
            .read_obj(GuestAddress(self.queues[q as usize].used + 2))
            .unwrap()
    }

    /// New used entries (id, len) since the last call.
    pub fn take_used(&mut self, q: u16) -> Vec<(u32, u32)> {
        let idx = self.used_idx(q);
        let dq = &mut self.queues[q as usize];
        let mut out = Vec::new();
        while dq.used_seen != idx {
            let e = dq.used + 4 + 8 * u64::from(dq.used_seen % dq.size);
            let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
            out.push((id, len));
            dq.used_seen = dq.used_seen.wrapping_add(1);
        }
        out
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    pub fn write(&self, addr: u64, data: &[u8]) {
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
    }

    /// Ack all pending interrupt bits.
    pub fn ack<D: VirtioDevice>(&self, t: &mut MmioTransport<D>) -> u32 {
        let s = rd32(t, VIRTIO_MMIO_INTERRUPT_STATUS);
        wr32(t, VIRTIO_MMIO_INTERRUPT_ACK, s);
        s
    }
}
