//! Virtio devices over the virtio-mmio (version 2, "modern") transport.
//!
//! [`MmioTransport`] implements the register file, feature negotiation, queue setup, interrupt
//! status and reset, and owns the queues (`virtio-queue`). A device ([`Block`], [`Net`],
//! [`Vsock`]) implements [`VirtioDevice`] and only sees descriptor chains through a
//! [`QueueCtx`].
//!
//! Threading model: queue notifications are processed synchronously on the vCPU thread that
//! wrote `QueueNotify`. Input that arrives from a backend on its own (net frames from the tap,
//! vsock host connections) is moved into the guest by [`MmioTransport::process_backend`]; the
//! VMM calls it from its event loop when one of [`MmioTransport::backend_fds`] is readable, or
//! runs a [`BackendWorker`] that does the polling on its own thread.
//!
//! Snapshots: with the vCPUs paused (and any [`BackendWorker`] paused), take
//! [`MmioTransport::state`] — an [`MmioState`] holding the register file, every queue's ring
//! addresses and next avail/used indices, and the device part ([`BlockState`], [`NetState`],
//! [`VsockState`]); all are serde types. Restore with
//! `MmioTransport::<Block>::restore(state, new_disk_file, guest_memory, irq_line)` (a tap
//! `OwnedFd` for [`Net`], a new unix socket path for [`Vsock`]); requests the guest had
//! published but the device had not yet taken are processed by the restored device.
//!
//! Hostile guests: any malformed request (descriptor loop, chain too long, buffer outside guest
//! memory, huge length) is completed with an error status where the device type has one, or with
//! a zero-length used entry. Queue-level corruption (avail index running ahead by more than the
//! queue size, rings outside memory, an out-of-range head index) sets
//! `DEVICE_NEEDS_RESET` in the status register and raises a configuration interrupt; the
//! device then ignores the queues until the driver resets it. Nothing panics.

pub mod block;
mod chain;
pub mod mmio;
pub mod net;
pub mod vsock;
mod worker;

use std::io;
use std::os::fd::RawFd;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;

pub use block::{Block, BlockBackend, BlockState};
pub use chain::{Buf, Chain, ChainCursor, ChainError};
pub use mmio::{MmioState, MmioTransport, MMIO_WINDOW_SIZE};
pub use net::{Net, NetState};
pub use vsock::{Vsock, VsockState};
pub use worker::BackendWorker;

/// Guest memory type shared with the VMM.
pub type GuestMemory = GuestMemoryMmap<()>;

/// Feature bit: the device complies with virtio 1.0+ (mandatory for modern mmio).
pub const VIRTIO_F_VERSION_1: u32 = virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

/// Errors a device reports to its transport. Any of them marks the device as needing reset.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The driver corrupted a queue (avail index, ring addresses, head index).
    #[error("virtqueue {queue}: {source}")]
    Queue {
        /// Queue index.
        queue: u16,
        /// What `virtio-queue` reported.
        source: virtio_queue::Error,
    },
    /// A queue index the device does not have.
    #[error("no virtqueue {0}")]
    NoSuchQueue(u16),
    /// The host backend failed in a way the guest cannot be told about per request.
    #[error("backend: {0}")]
    Backend(#[from] io::Error),
    /// A saved state does not fit this device.
    #[error("invalid device state: {0}")]
    InvalidState(String),
}

/// A virtio device type that a [`MmioTransport`] can carry.
pub trait VirtioDevice: Send + 'static {
    /// Device-specific part of a snapshot.
    type State: Serialize + DeserializeOwned + Clone + std::fmt::Debug;
    /// What a restore needs besides the state (a disk file, a tap fd, a socket path).
    type Backend;

    /// Virtio device id (1 net, 2 block, 19 vsock).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered to the driver (must include `VIRTIO_F_VERSION_1`).
    fn device_features(&self) -> u64;
    /// Reads device config space at `offset` (out-of-range bytes read as 0).
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device config space (read-only for all devices here).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver set DRIVER_OK with these features.
    fn activate(&mut self, _acked_features: u64) {}
    /// The driver reset the device: drop in-flight backend state.
    fn reset(&mut self);
    /// The driver notified queue `queue`.
    fn queue_notify(&mut self, queue: u16, ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError>;
    /// Moves backend input (rx frames, host connections) into the guest. Non-blocking.
    fn process_backend(&mut self, _ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Fds whose readability means [`VirtioDevice::process_backend`] has work.
    fn backend_fds(&self) -> Vec<RawFd> {
        Vec::new()
    }
    /// Device-specific state for a snapshot (taken while the VM is paused).
    fn state(&self) -> Self::State;
    /// Rebuilds the device from a snapshot onto a new backend.
    fn restore(state: Self::State, backend: Self::Backend) -> Result<Self, DeviceError>
    where
        Self: Sized;
    /// Called once after restore of an activated device, with working queues.
    fn restored(&mut self, _ctx: &mut QueueCtx<'_>) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// What a device may touch while handling a notification: guest memory and its queues.
/// Records which queues got used entries so the transport can interrupt once.
pub struct QueueCtx<'a> {
    /// Guest memory.
    pub mem: &'a GuestMemory,
    queues: &'a mut [Queue],
    used: u32,
}

impl<'a> QueueCtx<'a> {
    pub(crate) fn new(mem: &'a GuestMemory, queues: &'a mut [Queue]) -> Self {
        QueueCtx {
            mem,
            queues,
            used: 0,
        }
    }

    /// Bitmask of queues that got used entries.
    pub fn used_mask(&self) -> u32 {
        self.used
    }

    fn queue(&mut self, q: u16) -> Result<&mut Queue, DeviceError> {
        self.queues
            .get_mut(usize::from(q))
            .ok_or(DeviceError::NoSuchQueue(q))
    }

    /// Takes the next available chain of queue `q` and validates all its buffers.
    /// `Ok(None)`: queue empty (or not ready). `Ok(Some((head, Err(_))))`: a malformed chain
    /// that the device must still complete with [`QueueCtx::add_used`]`(q, head, 0)`.
    #[allow(clippy::type_complexity)]
    pub fn pop(&mut self, q: u16) -> Result<Option<(u16, Result<Chain, ChainError>)>, DeviceError> {
        let mem = self.mem;
        let queue = self.queue(q)?;
        if !queue.ready() {
            return Ok(None);
        }
        let mut iter = queue
            .iter(mem)
            .map_err(|source| DeviceError::Queue { queue: q, source })?;
        let Some(dc): Option<DescriptorChain<&GuestMemory>> = iter.next() else {
            return Ok(None);
        };
        let head = dc.head_index();
        Ok(Some((head, Chain::parse(dc, mem))))
    }

    /// Returns the last popped chain to the avail ring (e.g. no data to put in it yet).
    pub fn undo_pop(&mut self, q: u16) -> Result<(), DeviceError> {
        self.queue(q)?.go_to_previous_position();
        Ok(())
    }

    /// True when queue `q` has a chain available (without taking it).
    pub fn has_available(&mut self, q: u16) -> Result<bool, DeviceError> {
        let mem = self.mem;
        let queue = self.queue(q)?;
        if !queue.ready() {
            return Ok(false);
        }
        let avail = queue
            .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
            .map_err(|source| DeviceError::Queue { queue: q, source })?;
        Ok(avail.0 != queue.next_avail())
    }

    /// Completes chain `head` of queue `q` with `len` bytes written into its buffers.
    pub fn add_used(&mut self, q: u16, head: u16, len: u32) -> Result<(), DeviceError> {
        let mem = self.mem;
        self.queue(q)?
            .add_used(mem, head, len)
            .map_err(|source| DeviceError::Queue { queue: q, source })?;
        self.used |= 1 << q;
        Ok(())
    }
}

/// Serializable mirror of `virtio_queue::QueueState` (which has no serde support): ring
/// addresses and indices, so that a restored guest continues mid-flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// Maximum size offered by the device.
    pub max_size: u16,
    /// Next avail ring entry the device will read.
    pub next_avail: u16,
    /// Next used ring entry the device will write.
    pub next_used: u16,
    /// VIRTIO_F_RING_EVENT_IDX negotiated.
    pub event_idx_enabled: bool,
    /// Size chosen by the driver.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Descriptor table guest address.
    pub desc_table: u64,
    /// Avail ring guest address.
    pub avail_ring: u64,
    /// Used ring guest address.
    pub used_ring: u64,
}

impl From<QueueState> for QueueSnapshot {
    fn from(s: QueueState) -> Self {
        QueueSnapshot {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

impl From<QueueSnapshot> for QueueState {
    fn from(s: QueueSnapshot) -> Self {
        QueueState {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

/// Reads a little-endian config field window: copies `src[offset..]` into `data`, zero-filling
/// whatever lies beyond `src`.
pub(crate) fn read_config_bytes(src: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(off) = usize::try_from(offset) else {
        return;
    };
    if off >= src.len() {
        return;
    }
    let n = data.len().min(src.len() - off);
    data[..n].copy_from_slice(&src[off..off + n]);
}

#[cfg(test)]
pub(crate) mod testutil;
