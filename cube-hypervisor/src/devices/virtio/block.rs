//! virtio-blk backed by a host file, read-only or read-write. Requests run synchronously on the
//! notifying vCPU thread (pread/pwrite in 64 KiB pieces, so a huge request never allocates more).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;

use super::chain::{Chain, ChainCursor};
use super::{
    read_config_bytes, DeviceError, GuestMemory, QueueCtx, VirtioDevice, VIRTIO_F_VERSION_1,
};
use vm_memory::{Bytes, GuestAddress};

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
const QUEUE_SIZE: u16 = 256;
const IO_CHUNK: usize = 64 * 1024;
const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;

/// Saved block device state (the disk contents live in the backend file, not here).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// Capacity in 512-byte sectors the guest was told.
    pub capacity_sectors: u64,
    /// Read-only disk (VIRTIO_BLK_F_RO offered).
    pub read_only: bool,
    /// Serial returned by GET_ID (up to 20 bytes).
    pub disk_id: Vec<u8>,
}

/// What a block device is restored onto: a disk file of at least the saved capacity.
pub type BlockBackend = File;

/// File-backed virtio-blk device.
#[derive(Debug)]
pub struct Block {
    file: File,
    capacity_sectors: u64,
    read_only: bool,
    disk_id: Vec<u8>,
    queue_sizes: [u16; 1],
}

impl Block {
    /// A device over `file`. Capacity is the file length rounded down to whole sectors.
    pub fn new(file: File, read_only: bool, disk_id: &str) -> io::Result<Self> {
        let len = file.metadata()?.len();
        let mut id = disk_id.as_bytes().to_vec();
        id.truncate(ID_BYTES);
        Ok(Block {
            file,
            capacity_sectors: len / SECTOR_SIZE,
            read_only,
            disk_id: id,
            queue_sizes: [QUEUE_SIZE],
        })
    }

    /// Opens `path` (read-only or read-write) and wraps it.
    pub fn open(path: &Path, read_only: bool, disk_id: &str) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path)?;
        Self::new(file, read_only, disk_id)
    }

    /// Capacity in sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity_sectors
    }

    /// Checks that `[sector, sector + len)` lies inside the disk; returns the byte offset.
    fn byte_range(&self, sector: u64, len: u64) -> Option<u64> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            return None;
        }
        let start = sector.checked_mul(SECTOR_SIZE)?;
        let end = start.checked_add(len)?;
        (end <= self.capacity_sectors.checked_mul(SECTOR_SIZE)?).then_some(start)
    }

    fn read_into(
        &self,
        mem: &GuestMemory,
        data: &mut ChainCursor<'_>,
        mut pos: u64,
        mut len: u64,
    ) -> io::Result<()> {
        let mut buf = vec![0u8; IO_CHUNK.min(len as usize)];
        while len > 0 {
            let n = (len as usize).min(buf.len());
            self.file.read_exact_at(&mut buf[..n], pos)?;
            data.write(mem, &buf[..n]).map_err(io::Error::other)?;
            pos += n as u64;
            len -= n as u64;
        }
        Ok(())
    }

    fn write_from(
        &self,
        mem: &GuestMemory,
        data: &mut ChainCursor<'_>,
        mut pos: u64,
        mut len: u64,
    ) -> io::Result<()> {
        let mut buf = vec![0u8; IO_CHUNK.min(len as usize)];
        while len > 0 {
            let n = (len as usize).min(buf.len());
            let got = data.read(mem, &mut buf[..n]).map_err(io::Error::other)?;
            if got != n {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "short request",
                ));
            }
            self.file.write_all_at(&buf[..n], pos)?;
            pos += n as u64;
            len -= n as u64;
        }
        Ok(())
    }

    /// Executes one request. Returns bytes written to the guest (data + status byte), or None
    /// when the chain has no room for a status byte (completed with length 0).
    fn execute(&mut self, mem: &GuestMemory, chain: &Chain) -> Option<u32> {
        // The status byte is the last byte of the last writable buffer.
        let last = *chain.writable.last()?;
        if last.len == 0 {
            return None;
        }
        let status_addr = GuestAddress(last.addr.0 + u64::from(last.len) - 1);
        let mut data_bufs = chain.writable.clone();
        if let Some(l) = data_bufs.last_mut() {
            l.len -= 1;
        }
        let mut rd = ChainCursor::new(&chain.readable);
        let mut hdr = [0u8; 16];
        let (status, written) = match rd.read(mem, &mut hdr) {
            Ok(16) => {
                let rtype = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
                let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
                self.request(mem, rtype, sector, &mut rd, &data_bufs)
            }
            _ => (VIRTIO_BLK_S_IOERR, 0),
        };
        if mem.write_obj(status as u8, status_addr).is_err() {
            return None;
        }
        Some(written.saturating_add(1))
    }

    fn request(
        &mut self,
        mem: &GuestMemory,
        rtype: u32,
        sector: u64,
        rd: &mut ChainCursor<'_>,
        data_bufs: &[super::Buf],
    ) -> (u32, u32) {
        let mut wr = ChainCursor::new(data_bufs);
        match rtype {
            VIRTIO_BLK_T_IN => {
                let len = wr.remaining();
                let Some(pos) = self.byte_range(sector, len) else {
                    return (VIRTIO_BLK_S_IOERR, 0);
                };
                match self.read_into(mem, &mut wr, pos, len) {
                    Ok(()) => (VIRTIO_BLK_S_OK, len as u32),
                    Err(e) => {
                        tracing::warn!(error = %e, sector, "virtio-blk read failed");
                        (VIRTIO_BLK_S_IOERR, 0)
                    }
                }
            }
            VIRTIO_BLK_T_OUT => {
                if self.read_only {
                    // 5.2.6.2: IOERR and no data written for writes to a read-only device.
                    return (VIRTIO_BLK_S_IOERR, 0);
                }
                let len = rd.remaining();
                let Some(pos) = self.byte_range(sector, len) else {
                    return (VIRTIO_BLK_S_IOERR, 0);
                };
                match self.write_from(mem, rd, pos, len) {
                    Ok(()) => (VIRTIO_BLK_S_OK, 0),
                    Err(e) => {
                        tracing::warn!(error = %e, sector, "virtio-blk write failed");
                        (VIRTIO_BLK_S_IOERR, 0)
                    }
                }
            }
            VIRTIO_BLK_T_FLUSH => {
                if self.read_only {
                    return (VIRTIO_BLK_S_OK, 0);
                }
                match self.file.sync_data() {
                    Ok(()) => (VIRTIO_BLK_S_OK, 0),
                    Err(_) => (VIRTIO_BLK_S_IOERR, 0),
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let mut id = [0u8; ID_BYTES];
                id[..self.disk_id.len()].copy_from_slice(&self.disk_id);
                let n = (wr.remaining() as usize).min(ID_BYTES);
                match wr.write(mem, &id[..n]) {
                    Ok(n) => (VIRTIO_BLK_S_OK, n as u32),
                    Err(_) => (VIRTIO_BLK_S_IOERR, 0),
                }
            }
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        }
    }
}

impl VirtioDevice for Block {
    type State = BlockState;
    type Backend = BlockBackend;

    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn device_features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_BLK_F_FLUSH);
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_blk_config starts with `le64 capacity`; the rest is unused here.
        let mut cfg = [0u8; 8];
        cfg.copy_from_slice(&self.capacity_sectors.to_le_bytes());
        read_config_bytes(&cfg, offset, data);
    }

    fn reset(&mut self) {}

    fn queue_notify(&mut self, queue: u16, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        if queue != 0 {
            return Ok(());
        }
        while let Some((head, parsed)) = ctx.pop(0)? {
            let len = match parsed {
                Ok(chain) => self.execute(ctx.mem, &chain).unwrap_or(0),
                Err(e) => {
                    tracing::debug!(error = %e, "virtio-blk: malformed request");
                    0
                }
            };
            ctx.add_used(0, head, len)?;
        }
        Ok(())
    }

    fn state(&self) -> BlockState {
        BlockState {
            capacity_sectors: self.capacity_sectors,
            read_only: self.read_only,
            disk_id: self.disk_id.clone(),
        }
    }

    fn restore(state: BlockState, file: File) -> Result<Self, DeviceError> {
        let len = file.metadata()?.len();
        if len / SECTOR_SIZE < state.capacity_sectors {
            return Err(DeviceError::InvalidState(format!(
                "disk has {} sectors, snapshot expects {}",
                len / SECTOR_SIZE,
                state.capacity_sectors
            )));
        }
        if state.disk_id.len() > ID_BYTES {
            return Err(DeviceError::InvalidState(
                "disk id longer than 20 bytes".into(),
            ));
        }
        Ok(Block {
            file,
            capacity_sectors: state.capacity_sectors,
            read_only: state.read_only,
            disk_id: state.disk_id,
            queue_sizes: [QUEUE_SIZE],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;
    use crate::devices::irq::IrqLine;
    use crate::devices::virtio::testutil::*;
    use crate::devices::virtio::MmioTransport;
    use std::io::Write as _;
    use virtio_bindings::virtio_mmio::*;

    const SECTORS: u64 = 64;

    fn disk() -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..SECTORS * SECTOR_SIZE)
            .map(|i| (i / SECTOR_SIZE) as u8)
            .collect();
        f.write_all(&data).unwrap();
        f
    }

    fn setup(
        ro: bool,
    ) -> (
        tempfile::NamedTempFile,
        MmioTransport<Block>,
        Driver,
        IrqLine,
    ) {
        let f = disk();
        let dev = Block::open(f.path(), ro, "cube-disk-1").unwrap();
        let irq = IrqLine::new(5).unwrap();
        let mem = memory(4 << 20);
        let mut t = MmioTransport::new(dev, mem.clone(), irq.try_clone().unwrap()).unwrap();
        let mut d = Driver::new(mem);
        assert_eq!(rd32(&mut t, VIRTIO_MMIO_DEVICE_ID), 2);
        d.init(&mut t, 1, 16);
        (f, t, d, irq)
    }

    fn hdr(d: &mut Driver, rtype: u32, sector: u64) -> u64 {
        let a = d.alloc(16);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&rtype.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        d.write(a, &h);
        a
    }

    /// Submits a request and returns (status byte, used len).
    fn submit(
        t: &mut MmioTransport<Block>,
        d: &mut Driver,
        bufs: &[(u64, u32, bool)],
    ) -> (u8, u32) {
        let status = d.alloc(1);
        d.write(status, &[0xff]);
        let mut all = bufs.to_vec();
        all.push((status, 1, true));
        let head = d.add_chain(0, &all);
        d.notify(t, 0);
        let used = d.take_used(0);
        assert_eq!(used.len(), 1, "one completion");
        assert_eq!(used[0].0, u32::from(head));
        (d.read(status, 1)[0], used[0].1)
    }

    #[test]
    fn read_write_flush_get_id() {
        let (f, mut t, mut d, irq) = setup(false);
        let cfg = {
            let mut b = [0u8; 8];
            t.read(0x100, &mut b);
            u64::from_le_bytes(b)
        };
        assert_eq!(cfg, SECTORS);

        // Read sectors 3..5 into two separate buffers.
        let h = hdr(&mut d, VIRTIO_BLK_T_IN, 3);
        let (b1, b2) = (d.alloc(512), d.alloc(512));
        irq.take_count();
        let (st, len) = submit(
            &mut t,
            &mut d,
            &[(h, 16, false), (b1, 512, true), (b2, 512, true)],
        );
        assert_eq!((st, len), (VIRTIO_BLK_S_OK as u8, 1025));
        assert!(d.read(b1, 512).iter().all(|&x| x == 3));
        assert!(d.read(b2, 512).iter().all(|&x| x == 4));
        assert!(irq.take_count() > 0, "completion interrupts");
        assert_eq!(d.ack(&mut t), VIRTIO_MMIO_INT_VRING);
        assert_eq!(t.interrupt_status(), 0);

        // Write sector 10.
        let h = hdr(&mut d, VIRTIO_BLK_T_OUT, 10);
        let data = d.alloc(512);
        d.write(data, &[0xab; 512]);
        let (st, len) = submit(&mut t, &mut d, &[(h, 16, false), (data, 512, false)]);
        assert_eq!((st, len), (0, 1));
        let fh = hdr(&mut d, VIRTIO_BLK_T_FLUSH, 0);
        let (st, _) = submit(&mut t, &mut d, &[(fh, 16, false)]);
        assert_eq!(st, 0);
        let on_disk = std::fs::read(f.path()).unwrap();
        assert!(on_disk[5120..5632].iter().all(|&x| x == 0xab));
        assert!(
            on_disk[5632..6144].iter().all(|&x| x == 11),
            "neighbour untouched"
        );

        let h = hdr(&mut d, VIRTIO_BLK_T_GET_ID, 0);
        let idb = d.alloc(20);
        let (st, len) = submit(&mut t, &mut d, &[(h, 16, false), (idb, 20, true)]);
        assert_eq!((st, len), (0, 21));
        assert_eq!(&d.read(idb, 11), b"cube-disk-1");

        let uh = hdr(&mut d, 99, 0);
        let (st, _) = submit(&mut t, &mut d, &[(uh, 16, false)]);
        assert_eq!(st, VIRTIO_BLK_S_UNSUPP as u8);
        assert!(!t.needs_reset());
    }

    #[test]
    fn read_only_rejects_writes_and_bounds_are_checked() {
        let (f, mut t, mut d, _irq) = setup(true);
        wr32(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
        assert_ne!(
            rd32(&mut t, VIRTIO_MMIO_DEVICE_FEATURES) & (1 << VIRTIO_BLK_F_RO),
            0
        );
        let h = hdr(&mut d, VIRTIO_BLK_T_OUT, 1);
        let data = d.alloc(512);
        d.write(data, &[0xee; 512]);
        let (st, len) = submit(&mut t, &mut d, &[(h, 16, false), (data, 512, false)]);
        assert_eq!((st, len), (VIRTIO_BLK_S_IOERR as u8, 1));
        assert_eq!(std::fs::read(f.path()).unwrap(), {
            let mut v = Vec::new();
            for s in 0..SECTORS {
                v.extend(std::iter::repeat_n(s as u8, 512));
            }
            v
        });
        let fh = hdr(&mut d, VIRTIO_BLK_T_FLUSH, 0);
        let (st, _) = submit(&mut t, &mut d, &[(fh, 16, false)]);
        assert_eq!(st, 0, "flush on a read-only disk is fine");

        // Past the end, overflowing sector numbers, partial sectors.
        for (sector, len) in [
            (SECTORS - 1, 1024u32),
            (SECTORS, 512),
            (u64::MAX, 512),
            (u64::MAX / 512 + 1, 512),
            (0, 100),
        ] {
            let h = hdr(&mut d, VIRTIO_BLK_T_IN, sector);
            let b = d.alloc(u64::from(len));
            let (st, _) = submit(&mut t, &mut d, &[(h, 16, false), (b, len, true)]);
            assert_eq!(st, VIRTIO_BLK_S_IOERR as u8, "sector {sector} len {len}");
        }
        // A last sector read is fine.
        let h = hdr(&mut d, VIRTIO_BLK_T_IN, SECTORS - 1);
        let b = d.alloc(512);
        let (st, _) = submit(&mut t, &mut d, &[(h, 16, false), (b, 512, true)]);
        assert_eq!(st, 0);
        assert!(!t.needs_reset());
    }

    #[test]
    fn hostile_chains_complete_with_errors_without_breaking_the_device() {
        let (_f, mut t, mut d, _irq) = setup(false);
        let h = hdr(&mut d, VIRTIO_BLK_T_IN, 0);
        // Loop: 0 -> 1 -> 0 ...
        d.write_desc(0, 0, h, 16, F_NEXT, 1);
        d.write_desc(0, 1, h, 16, F_NEXT, 0);
        d.publish(0, 0);
        // Next index out of the table.
        d.write_desc(0, 2, h, 16, F_NEXT, 999);
        d.publish(0, 2);
        // Buffer outside guest memory, and a huge length starting inside memory.
        d.write_desc(0, 3, 0xffff_ffff_f000, 16, F_NEXT, 4);
        d.write_desc(0, 4, 0x100000, 0xffff_fff0, F_WRITE, 0);
        d.publish(0, 3);
        d.write_desc(0, 5, h, 16, F_NEXT, 6);
        d.write_desc(0, 6, 0x100000, 0xffff_fff0, F_WRITE, 0);
        d.publish(0, 5);
        // Readable after writable; no status byte at all (zero-length last buffer).
        d.write_desc(0, 7, h, 16, F_WRITE | F_NEXT, 8);
        d.write_desc(0, 8, h, 16, 0, 0);
        d.publish(0, 7);
        d.write_desc(0, 9, h, 16, F_NEXT, 10);
        d.write_desc(0, 10, h, 0, F_WRITE, 0);
        d.publish(0, 9);
        // Header too short: IOERR in the status byte.
        let st = d.alloc(1);
        d.write_desc(0, 11, h, 8, F_NEXT, 12);
        d.write_desc(0, 12, st, 1, F_WRITE, 0);
        d.publish(0, 11);
        d.notify(&mut t, 0);
        let used = d.take_used(0);
        assert_eq!(
            used,
            vec![(0, 0), (2, 0), (3, 0), (5, 0), (7, 0), (9, 0), (11, 1)]
        );
        assert_eq!(d.read(st, 1)[0], VIRTIO_BLK_S_IOERR as u8);
        assert!(
            !t.needs_reset(),
            "per-request garbage does not break the device"
        );

        // A chain as long as the whole table (every descriptor chained, the last back to 0).
        for i in 0..16u16 {
            d.write_desc(0, i, h, 16, F_NEXT, (i + 1) % 16);
        }
        d.publish(0, 0);
        d.notify(&mut t, 0);
        assert_eq!(d.take_used(0), vec![(0, 0)]);

        // Still serves a good request afterwards.
        let h = hdr(&mut d, VIRTIO_BLK_T_IN, 7);
        let b = d.alloc(512);
        let (st, _) = submit(&mut t, &mut d, &[(h, 16, false), (b, 512, true)]);
        assert_eq!(st, 0);
        assert!(d.read(b, 512).iter().all(|&x| x == 7));
    }

    #[test]
    fn queue_corruption_needs_reset_then_recovers() {
        let (_f, mut t, mut d, irq) = setup(false);
        // Head index beyond the queue size.
        let q = d.queues[0].clone();
        d.write(q.avail + 4, &200u16.to_le_bytes());
        d.write(q.avail + 2, &1u16.to_le_bytes());
        irq.take_count();
        d.notify(&mut t, 0);
        assert!(t.needs_reset());
        assert_ne!(rd32(&mut t, VIRTIO_MMIO_STATUS) & 0x40, 0);
        assert_ne!(
            rd32(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS) & VIRTIO_MMIO_INT_CONFIG,
            0
        );
        assert!(irq.take_count() > 0);
        // Broken: notifications are ignored until reset.
        d.notify(&mut t, 0);
        // Reset and re-init work.
        d.init(&mut t, 1, 16);
        assert!(!t.needs_reset());
        // avail idx running ahead by more than the queue size.
        d.write(q.avail + 2, &100u16.to_le_bytes());
        d.notify(&mut t, 0);
        assert!(t.needs_reset());

        // Bad queue sizes during setup: not a power of two, above max.
        for bad in [3u32, 512, 0x1_0000] {
            wr32(&mut t, VIRTIO_MMIO_STATUS, 0);
            wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2);
            wr32(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
            wr32(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
            wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2 | 8);
            wr32(&mut t, VIRTIO_MMIO_QUEUE_NUM, bad);
            assert!(t.needs_reset(), "queue size {bad}");
        }
        // Rings outside guest memory are refused at DRIVER_OK.
        wr32(&mut t, VIRTIO_MMIO_STATUS, 0);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2);
        wr32(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr32(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2 | 8);
        wr32(&mut t, VIRTIO_MMIO_QUEUE_DESC_LOW, 0xfff0_0000);
        wr32(&mut t, VIRTIO_MMIO_QUEUE_DESC_HIGH, 0x10);
        wr32(&mut t, VIRTIO_MMIO_QUEUE_READY, 1);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2 | 8 | 4);
        assert!(t.needs_reset());
        // Features without VERSION_1 or beyond the offer are refused (FEATURES_OK stays clear).
        wr32(&mut t, VIRTIO_MMIO_STATUS, 0);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2 | 8);
        assert_eq!(rd32(&mut t, VIRTIO_MMIO_STATUS) & 8, 0);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 0);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2);
        wr32(&mut t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr32(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 1 | 0x8000);
        wr32(&mut t, VIRTIO_MMIO_STATUS, 1 | 2 | 8);
        assert_eq!(rd32(&mut t, VIRTIO_MMIO_STATUS) & 8, 0);
        // Odd-width and unaligned register accesses are ignored.
        t.write(0x70, &[0]);
        t.write(0x71, &[0, 0, 0, 0]);
        let mut b = [0xffu8; 2];
        t.read(0, &mut b);
        assert_eq!(b, [0, 0]);
    }

    #[test]
    fn snapshot_restore_onto_new_disk_continues_mid_flight() {
        let (_f, mut t, mut d, _irq) = setup(false);
        // Two completed requests so the indices are not at zero.
        for _ in 0..2 {
            let fh = hdr(&mut d, VIRTIO_BLK_T_FLUSH, 0);
            let (st, _) = submit(&mut t, &mut d, &[(fh, 16, false)]);
            assert_eq!(st, 0);
        }
        // A write the guest published but the device has not seen yet (no notify).
        let h = hdr(&mut d, VIRTIO_BLK_T_OUT, 20);
        let data = d.alloc(512);
        d.write(data, &[0x77; 512]);
        let status = d.alloc(1);
        d.write(status, &[0xff]);
        d.add_chain(0, &[(h, 16, false), (data, 512, false), (status, 1, true)]);

        let st = t.state();
        assert_eq!(st.queues[0].next_avail, 2);
        assert_eq!(st.queues[0].next_used, 2);
        let json = serde_json::to_string(&st).unwrap();
        let st: crate::devices::virtio::MmioState<BlockState> =
            serde_json::from_str(&json).unwrap();
        drop(t);

        // The clone gets its own copy of the disk.
        let clone_disk = disk();
        let small = tempfile::NamedTempFile::new().unwrap();
        let err = MmioTransport::<Block>::restore(
            st.clone(),
            small.reopen().unwrap(),
            d.mem.clone(),
            IrqLine::new(6).unwrap(),
        );
        assert!(
            matches!(err, Err(DeviceError::InvalidState(_))),
            "too-small disk refused"
        );
        let err = MmioTransport::<Block>::restore(
            st.clone(),
            disk().reopen().unwrap(),
            memory(64 << 10),
            IrqLine::new(6).unwrap(),
        );
        assert!(
            matches!(err, Err(DeviceError::InvalidState(_))),
            "rings outside new memory refused"
        );
        let mut bad = st.clone();
        bad.queues[0].size = 3;
        assert!(MmioTransport::<Block>::restore(
            bad,
            disk().reopen().unwrap(),
            d.mem.clone(),
            IrqLine::new(6).unwrap()
        )
        .is_err());
        let mut bad = st.clone();
        bad.version = 99;
        assert!(MmioTransport::<Block>::restore(
            bad,
            disk().reopen().unwrap(),
            d.mem.clone(),
            IrqLine::new(6).unwrap()
        )
        .is_err());
        let irq2 = IrqLine::new(6).unwrap();
        let mut t2 = MmioTransport::<Block>::restore(
            st,
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(clone_disk.path())
                .unwrap(),
            d.mem.clone(),
            irq2.try_clone().unwrap(),
        )
        .unwrap();
        assert!(t2.is_active());
        d.notify(&mut t2, 0);
        assert_eq!(d.take_used(0).len(), 1);
        assert_eq!(d.used_idx(0), 3);
        assert_eq!(d.read(status, 1)[0], 0);
        assert!(
            irq2.take_count() > 0,
            "restored device interrupts on its new line"
        );
        let on_disk = std::fs::read(clone_disk.path()).unwrap();
        assert!(on_disk[20 * 512..21 * 512].iter().all(|&x| x == 0x77));
        // And keeps serving new requests.
        let hh = hdr(&mut d, VIRTIO_BLK_T_IN, 20);
        let b = d.alloc(512);
        let (st, _) = submit(&mut t2, &mut d, &[(hh, 16, false), (b, 512, true)]);
        assert_eq!(st, 0);
        assert!(d.read(b, 512).iter().all(|&x| x == 0x77));
    }
}
