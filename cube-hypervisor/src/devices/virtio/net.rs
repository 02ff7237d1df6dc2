//! virtio-net over a tap-like fd (any fd on which one read/write is one ethernet frame: a tap
//! opened with `IFF_TAP|IFF_NO_PI`, or a `SOCK_SEQPACKET`/`SOCK_DGRAM` socketpair in tests).
//!
//! TX is processed when the guest notifies queue 1. RX is moved into the guest by
//! `process_backend()` (VMM event loop or [`super::BackendWorker`]) and whenever the guest adds
//! rx buffers. No offloads are offered, so the `virtio_net_hdr_v1` is all zeros apart from
//! `num_buffers = 1`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;

use super::chain::ChainCursor;
use super::{read_config_bytes, DeviceError, QueueCtx, VirtioDevice, VIRTIO_F_VERSION_1};

/// Size of `struct virtio_net_hdr_v1` (VERSION_1 devices always use it).
pub const NET_HDR_LEN: usize = 12;
/// Largest frame accepted either way (64 KiB payload + ethernet header + VLAN tag).
pub const MAX_FRAME: usize = 65536 + 14 + 4;
const RX_QUEUE: u16 = 0;
const TX_QUEUE: u16 = 1;
const QUEUE_SIZE: u16 = 256;
/// Frames moved per call, so one busy backend cannot pin a vCPU thread.
const BATCH: usize = 256;

/// Saved net device state. The tap itself is reopened by the VMM (by name, in the clone's
/// network namespace) and handed to the restore constructor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// MAC address shown to the guest.
    pub mac: [u8; 6],
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd we own, no pointers involved.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// virtio-net device.
#[derive(Debug)]
pub struct Net {
    tap: OwnedFd,
    mac: [u8; 6],
    /// A frame read from the tap that found no rx buffer yet.
    pending_rx: Option<Vec<u8>>,
    /// The guest had no rx buffers last time: stop polling the tap until it adds some.
    rx_starved: bool,
    queue_sizes: [u16; 2],
    /// Counters for observability/tests.
    pub stats: NetStats,
}

/// Frame counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetStats {
    /// Frames written to the tap.
    pub tx_frames: u64,
    /// Guest frames dropped (malformed, too big, tap error).
    pub tx_dropped: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Host frames dropped (rx buffer too small).
    pub rx_dropped: u64,
}

impl Net {
    /// A device on `tap` (set to non-blocking here) with guest MAC `mac`.
    pub fn new(tap: OwnedFd, mac: [u8; 6]) -> io::Result<Self> {
        set_nonblocking(tap.as_raw_fd())?;
        Ok(Net {
            tap,
            mac,
            pending_rx: None,
            rx_starved: false,
            queue_sizes: [QUEUE_SIZE; 2],
            stats: NetStats::default(),
        })
    }

    fn process_tx(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        let mut frame = vec![0u8; NET_HDR_LEN + MAX_FRAME];
        while let Some((head, parsed)) = ctx.pop(TX_QUEUE)? {
            match parsed {
                Ok(chain) if chain.readable_len() <= frame.len() as u64 => {
                    let mut cur = ChainCursor::new(&chain.readable);
                    let n = cur.read(ctx.mem, &mut frame).unwrap_or(0);
                    if n <= NET_HDR_LEN {
                        self.stats.tx_dropped += 1;
                    } else {
                        let data = &frame[NET_HDR_LEN..n];
                        // SAFETY: writes from a valid buffer of the given length.
                        let r = unsafe {
                            libc::write(self.tap.as_raw_fd(), data.as_ptr().cast(), data.len())
                        };
                        if r < 0 {
                            // A full or gone tap loses the frame, like a real link would.
                            tracing::debug!(error = %io::Error::last_os_error(), "tap write failed");
                            self.stats.tx_dropped += 1;
                        } else {
                            self.stats.tx_frames += 1;
                        }
                    }
                }
                _ => self.stats.tx_dropped += 1,
            }
            ctx.add_used(TX_QUEUE, head, 0)?;
        }
        Ok(())
    }

    fn read_tap(&mut self) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; MAX_FRAME];
        // SAFETY: reads into a valid buffer of the given length.
        let r = unsafe { libc::read(self.tap.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if r <= 0 {
            return None;
        }
        buf.truncate(r as usize);
        Some(buf)
    }

    fn process_rx(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        for _ in 0..BATCH {
            let frame = match self.pending_rx.take() {
                Some(f) => f,
                None => match self.read_tap() {
                    Some(f) => f,
                    None => break,
                },
            };
            let Some((head, parsed)) = ctx.pop(RX_QUEUE)? else {
                self.pending_rx = Some(frame);
                self.rx_starved = true;
                return Ok(());
            };
            let mut len = 0;
            match parsed {
                Ok(chain) if chain.writable_len() >= (NET_HDR_LEN + frame.len()) as u64 => {
                    let mut hdr = [0u8; NET_HDR_LEN];
                    hdr[10] = 1; // num_buffers
                    let mut cur = ChainCursor::new(&chain.writable);
                    let ok = cur.write(ctx.mem, &hdr).is_ok() && cur.write(ctx.mem, &frame).is_ok();
                    if ok {
                        len = (NET_HDR_LEN + frame.len()) as u32;
                        self.stats.rx_frames += 1;
                    } else {
                        self.stats.rx_dropped += 1;
                    }
                }
                _ => self.stats.rx_dropped += 1,
            }
            ctx.add_used(RX_QUEUE, head, len)?;
        }
        self.rx_starved = false;
        Ok(())
    }
}

impl VirtioDevice for Net {
    type State = NetState;
    type Backend = OwnedFd;

    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn device_features(&self) -> u64 {
        (1u64 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_MAC)
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config: mac[6], then fields for features not offered.
        read_config_bytes(&self.mac, offset, data);
    }

    fn reset(&mut self) {
        self.pending_rx = None;
        self.rx_starved = false;
    }

    fn queue_notify(&mut self, queue: u16, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        match queue {
            TX_QUEUE => self.process_tx(ctx),
            RX_QUEUE => {
                self.rx_starved = false;
                self.process_rx(ctx)
            }
            _ => Ok(()),
        }
    }

    fn process_backend(&mut self, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        self.process_rx(ctx)
    }

    fn backend_fds(&self) -> Vec<RawFd> {
        if self.rx_starved {
            Vec::new()
        } else {
            vec![self.tap.as_raw_fd()]
        }
    }

    fn state(&self) -> NetState {
        NetState { mac: self.mac }
    }

    fn restore(state: NetState, tap: OwnedFd) -> Result<Self, DeviceError> {
        Ok(Net::new(tap, state.mac)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::irq::IrqLine;
    use crate::devices::virtio::testutil::*;
    use crate::devices::virtio::MmioTransport;
    use std::os::fd::FromRawFd;

    const MAC: [u8; 6] = [0x02, 0xcb, 0, 0, 0, 7];

    /// A SOCK_SEQPACKET pair: one frame per read/write, like a tap.
    fn pair() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two fds into the array.
        let r =
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr()) };
        assert_eq!(r, 0);
        // SAFETY: both fds were just created and are owned by nobody else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn send(fd: &OwnedFd, data: &[u8]) {
        // SAFETY: valid buffer.
        let r = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
        assert_eq!(r as usize, data.len());
    }

    fn recv(fd: &OwnedFd) -> Option<Vec<u8>> {
        let mut b = vec![0u8; 70000];
        // SAFETY: valid buffer.
        let r = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                b.as_mut_ptr().cast(),
                b.len(),
                libc::MSG_DONTWAIT,
            )
        };
        (r >= 0).then(|| {
            b.truncate(r as usize);
            b
        })
    }

    fn frame(n: usize, fill: u8) -> Vec<u8> {
        let mut f = vec![fill; n];
        f[..6].copy_from_slice(&MAC);
        f
    }

    fn setup() -> (MmioTransport<Net>, Driver, OwnedFd, IrqLine) {
        let (dev_end, host_end) = pair();
        let irq = IrqLine::new(7).unwrap();
        let mem = memory(4 << 20);
        let mut t = MmioTransport::new(
            Net::new(dev_end, MAC).unwrap(),
            mem.clone(),
            irq.try_clone().unwrap(),
        )
        .unwrap();
        let mut d = Driver::new(mem);
        d.init(&mut t, 2, 16);
        (t, d, host_end, irq)
    }

    fn tx(t: &mut MmioTransport<Net>, d: &mut Driver, f: &[u8]) {
        let h = d.alloc(12);
        let b = d.alloc(f.len() as u64);
        d.write(b, f);
        d.add_chain(TX_QUEUE, &[(h, 12, false), (b, f.len() as u32, false)]);
        d.notify(t, TX_QUEUE);
    }

    #[test]
    fn tx_and_rx_frames() {
        let (mut t, mut d, host, irq) = setup();
        let mut mac = [0u8; 6];
        crate::devices::bus::BusDevice::read(&mut t, 0x100, &mut mac);
        assert_eq!(mac, MAC);

        let f = frame(60, 0x11);
        tx(&mut t, &mut d, &f);
        assert_eq!(
            recv(&host).unwrap(),
            f,
            "frame minus virtio_net_hdr reaches the tap"
        );
        assert_eq!(d.take_used(TX_QUEUE).len(), 1);

        // Host frame arrives before any rx buffer: it waits, and the tap is not polled meanwhile.
        let big = frame(1514, 0x22);
        send(&host, &big);
        t.process_backend();
        assert!(
            t.backend_fds().is_empty(),
            "starved rx stops polling the tap"
        );
        let rx = d.alloc(1526);
        irq.take_count();
        d.add_chain(RX_QUEUE, &[(rx, 1526, true)]);
        d.notify(&mut t, RX_QUEUE);
        assert_eq!(d.take_used(RX_QUEUE), vec![(0, 1526)]);
        let got = d.read(rx, 1526);
        assert_eq!(&got[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        assert_eq!(&got[12..], &big[..]);
        assert!(irq.take_count() > 0);
        assert_eq!(t.backend_fds().len(), 1);

        // A frame split across two rx descriptors; a second waits for the next buffer.
        send(&host, &frame(100, 0x33));
        send(&host, &frame(90, 0x44));
        let (a, b) = (d.alloc(50), d.alloc(2000));
        d.add_chain(RX_QUEUE, &[(a, 50, true), (b, 2000, true)]);
        t.process_backend();
        assert_eq!(d.take_used(RX_QUEUE), vec![(1, 112)]);
        let mut whole = d.read(a, 50);
        whole.extend(d.read(b, 62));
        assert_eq!(&whole[12..], &frame(100, 0x33)[..]);
        let c = d.alloc(200);
        d.add_chain(RX_QUEUE, &[(c, 200, true)]);
        d.notify(&mut t, RX_QUEUE);
        assert_eq!(d.take_used(RX_QUEUE), vec![(3, 102)]);
        assert_eq!(t.device().stats.rx_frames, 3);
    }

    #[test]
    fn hostile_tx_and_small_rx_buffers() {
        let (mut t, mut d, host, _irq) = setup();
        // Oversized frame (above MAX_FRAME), header-only frame, out-of-range buffer, loop.
        let h = d.alloc(12);
        d.add_chain(
            TX_QUEUE,
            &[(h, 12, false), (0x100000, (MAX_FRAME + 100) as u32, false)],
        );
        d.add_chain(TX_QUEUE, &[(h, 12, false)]);
        d.add_chain(TX_QUEUE, &[(h, 12, false), (0x7fff_0000_0000, 100, false)]);
        d.write_desc(TX_QUEUE, 10, h, 12, F_NEXT, 11);
        d.write_desc(TX_QUEUE, 11, h, 12, F_NEXT, 10);
        d.publish(TX_QUEUE, 10);
        d.notify(&mut t, TX_QUEUE);
        assert_eq!(d.take_used(TX_QUEUE).len(), 4);
        assert!(recv(&host).is_none(), "nothing malformed reaches the tap");
        assert_eq!(t.device().stats.tx_dropped, 4);
        assert!(!t.needs_reset());

        // An rx buffer too small for header + frame: frame dropped, buffer returned empty.
        send(&host, &frame(500, 1));
        let s = d.alloc(100);
        d.add_chain(RX_QUEUE, &[(s, 100, true)]);
        t.process_backend();
        assert_eq!(d.take_used(RX_QUEUE), vec![(0, 0)]);
        assert_eq!(t.device().stats.rx_dropped, 1);
        // Read-only rx buffer (device-readable): malformed for rx, also returned empty.
        send(&host, &frame(60, 2));
        d.add_chain(RX_QUEUE, &[(s, 100, false)]);
        t.process_backend();
        assert_eq!(d.take_used(RX_QUEUE), vec![(1, 0)]);
        assert!(!t.needs_reset());
    }

    #[test]
    fn snapshot_restore_onto_new_tap() {
        let (mut t, mut d, host, _irq) = setup();
        tx(&mut t, &mut d, &frame(60, 5));
        assert!(recv(&host).is_some());
        // Guest posts an rx buffer and a tx frame before the snapshot; neither processed yet.
        let rx = d.alloc(2048);
        d.add_chain(RX_QUEUE, &[(rx, 2048, true)]);
        let h = d.alloc(12);
        let b = d.alloc(64);
        d.write(b, &frame(64, 6));
        d.add_chain(TX_QUEUE, &[(h, 12, false), (b, 64, false)]);
        let st = t.state();
        let st: MmioState<NetState> =
            serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
        drop(t);
        drop(host);

        let (dev2, host2) = pair();
        let mut t2 =
            MmioTransport::<Net>::restore(st, dev2, d.mem.clone(), IrqLine::new(7).unwrap())
                .unwrap();
        d.notify(&mut t2, TX_QUEUE);
        assert_eq!(
            recv(&host2).unwrap(),
            frame(64, 6),
            "in-flight tx goes out on the new tap"
        );
        send(&host2, &frame(80, 9));
        t2.process_backend();
        assert_eq!(d.take_used(RX_QUEUE), vec![(0, 92)]);
        assert_eq!(&d.read(rx + 12, 80), &frame(80, 9)[..]);
        let mut mac = [0u8; 6];
        crate::devices::bus::BusDevice::read(&mut t2, 0x100, &mut mac);
        assert_eq!(mac, MAC);
    }

    use crate::devices::virtio::MmioState;

    #[test]
    fn backend_worker_delivers_rx_and_pauses() {
        use crate::devices::virtio::BackendWorker;
        use std::sync::{Arc, Mutex};
        use std::time::{Duration, Instant};
        let (t, mut d, host, _irq) = setup();
        let t = Arc::new(Mutex::new(t));
        let w = BackendWorker::spawn(t.clone()).unwrap();
        let rx = d.alloc(4096);
        {
            let mut g = t.lock().unwrap();
            d.add_chain(RX_QUEUE, &[(rx, 2048, true)]);
            d.add_chain(RX_QUEUE, &[(rx + 2048, 2048, true)]);
            d.notify(&mut *g, RX_QUEUE);
        }
        let wait_used = |d: &Driver, n: u16| {
            let t0 = Instant::now();
            while d.used_idx(RX_QUEUE) < n && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(2));
            }
            d.used_idx(RX_QUEUE)
        };
        send(&host, &frame(60, 1));
        assert_eq!(
            wait_used(&d, 1),
            1,
            "worker moved the frame without any VMM call"
        );
        w.pause();
        send(&host, &frame(60, 2));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            d.used_idx(RX_QUEUE),
            1,
            "paused worker does not touch the device"
        );
        let st = t.lock().unwrap().state();
        assert_eq!(st.queues[0].next_used, 1);
        w.resume();
        assert_eq!(wait_used(&d, 2), 2);
        w.stop();
    }
}
