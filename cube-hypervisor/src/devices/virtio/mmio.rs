//! virtio-mmio version 2 transport: the 4 KiB register window of one device.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueT};

use super::{DeviceError, GuestMemory, QueueCtx, QueueSnapshot, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::bus::BusDevice;
use crate::devices::irq::IrqLine;
use std::os::fd::RawFd;

/// Size of each device's MMIO window.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;
const MAGIC: u32 = 0x7472_6976; // "virt"
const VENDOR_ID: u32 = 0x4542_5543; // "CUBE"
const STATE_VERSION: u32 = 1;

/// Snapshot of a transport and its device: register state, queues, device-specific state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MmioState<S> {
    /// Layout version of this struct.
    pub version: u32,
    /// Virtio device id, checked on restore.
    pub device_type: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// Features the driver wrote.
    pub acked_features: u64,
    /// QueueSel.
    pub queue_sel: u32,
    /// Device status register.
    pub status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus (pending, not yet acked).
    pub interrupt_status: u32,
    /// Queues: addresses, sizes, next avail/used indices.
    pub queues: Vec<QueueSnapshot>,
    /// Device-specific state.
    pub device: S,
}

/// The virtio-mmio register file around one device `D`. Insert on the MMIO bus with
/// [`MMIO_WINDOW_SIZE`] and describe it to the guest with [`MmioTransport::cmdline`].
pub struct MmioTransport<D: VirtioDevice> {
    device: D,
    mem: GuestMemory,
    irq: IrqLine,
    queues: Vec<Queue>,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    status: u32,
    config_generation: u32,
    interrupt_status: u32,
    /// The backend worker's wake-up (see `worker.rs`): kicked after every guest notification,
    /// which is what changes the set of fds the worker must watch.
    backend_wake: Option<std::sync::Arc<vmm_sys_util::eventfd::EventFd>>,
}

impl<D: VirtioDevice> std::fmt::Debug for MmioTransport<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device.device_type())
            .field("status", &self.status)
            .field("gsi", &self.irq.gsi())
            .finish()
    }
}

impl MmioTransport<super::Block> {
    /// Kernel command-line fragment describing a virtio-mmio device at `base` on `gsi`
    /// (needs `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`). The same for every device type; call it
    /// as `MmioTransport::cmdline(base, gsi)`.
    pub fn cmdline(base: u64, gsi: u32) -> String {
        format!("virtio_mmio.device=4K@{base:#x}:{gsi}")
    }
}

fn make_queues(sizes: &[u16]) -> Result<Vec<Queue>, DeviceError> {
    sizes
        .iter()
        .map(|&s| {
            Queue::new(s).map_err(|e| DeviceError::InvalidState(format!("queue size {s}: {e}")))
        })
        .collect()
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// Wraps `device`, giving it access to `mem` and interrupting through `irq`.
    pub fn new(device: D, mem: GuestMemory, irq: IrqLine) -> Result<Self, DeviceError> {
        let queues = make_queues(device.queue_max_sizes())?;
        Ok(MmioTransport {
            device,
            mem,
            irq,
            queues,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            status: 0,
            config_generation: 0,
            interrupt_status: 0,
            backend_wake: None,
        })
    }

    /// The wrapped device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The wrapped device, mutably.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The interrupt line (register its eventfd with KVM).
    pub fn irq(&self) -> &IrqLine {
        &self.irq
    }

    /// Device status register (e.g. to see `DEVICE_NEEDS_RESET`, 0x40).
    pub fn status(&self) -> u32 {
        self.status
    }

    /// InterruptStatus register (bit 0 used buffer, bit 1 config change).
    pub fn interrupt_status(&self) -> u32 {
        self.interrupt_status
    }

    /// True once the driver has set DRIVER_OK and the device has not failed.
    pub fn is_active(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0
            && self.status & (VIRTIO_CONFIG_S_NEEDS_RESET | VIRTIO_CONFIG_S_FAILED) == 0
    }

    /// True when the device gave up on a misbehaving driver and waits for a reset.
    pub fn needs_reset(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_NEEDS_RESET != 0
    }

    /// Fds the VMM should poll; when one is readable call [`MmioTransport::process_backend`].
    pub fn backend_fds(&self) -> Vec<RawFd> {
        self.device.backend_fds()
    }

    /// Where to signal the backend worker that the fds to watch may have changed.
    pub fn set_backend_wake(&mut self, wake: std::sync::Arc<vmm_sys_util::eventfd::EventFd>) {
        self.backend_wake = Some(wake);
    }

    fn kick_backend(&self) {
        if let Some(w) = &self.backend_wake {
            let _ = w.write(1);
        }
    }

    /// Moves pending backend input into the guest (no-op until the driver is ready).
    pub fn process_backend(&mut self) {
        if !self.is_active() {
            return;
        }
        self.run(|dev, ctx| dev.process_backend(ctx));
    }

    /// Snapshot of registers, queues and device state. Take it while the vCPUs are paused.
    pub fn state(&self) -> MmioState<D::State> {
        MmioState {
            version: STATE_VERSION,
            device_type: self.device.device_type(),
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            status: self.status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt_status,
            queues: self.queues.iter().map(|q| q.state().into()).collect(),
            device: self.device.state(),
        }
    }

    /// Rebuilds a transport and its device from `state` onto a new backend, new guest memory
    /// and a new interrupt line. A pending interrupt is re-raised so the guest does not miss it.
    pub fn restore(
        state: MmioState<D::State>,
        backend: D::Backend,
        mem: GuestMemory,
        irq: IrqLine,
    ) -> Result<Self, DeviceError> {
        if state.version != STATE_VERSION {
            return Err(DeviceError::InvalidState(format!(
                "mmio state version {} (expected {STATE_VERSION})",
                state.version
            )));
        }
        let device = D::restore(state.device, backend)?;
        if device.device_type() != state.device_type {
            return Err(DeviceError::InvalidState(format!(
                "device type {} restored as {}",
                state.device_type,
                device.device_type()
            )));
        }
        let max_sizes = device.queue_max_sizes();
        if max_sizes.len() != state.queues.len() {
            return Err(DeviceError::InvalidState(format!(
                "{} queues saved, device has {}",
                state.queues.len(),
                max_sizes.len()
            )));
        }
        let mut queues = Vec::with_capacity(max_sizes.len());
        for (i, (qs, &max)) in state.queues.iter().zip(max_sizes).enumerate() {
            if qs.max_size != max {
                return Err(DeviceError::InvalidState(format!(
                    "queue {i} max size {} saved, device has {max}",
                    qs.max_size
                )));
            }
            let q = Queue::try_from(virtio_queue::QueueState::from(*qs))
                .map_err(|e| DeviceError::InvalidState(format!("queue {i}: {e}")))?;
            queues.push(q);
        }
        let mut t = MmioTransport {
            device,
            mem,
            irq,
            queues,
            device_features_sel: state.device_features_sel,
            driver_features_sel: state.driver_features_sel,
            acked_features: state.acked_features,
            queue_sel: state.queue_sel,
            status: state.status,
            config_generation: state.config_generation,
            interrupt_status: state.interrupt_status,
            backend_wake: None,
        };
        if t.is_active() {
            if let Some(i) = t
                .queues
                .iter()
                .position(|q| q.ready() && !q.is_valid(&t.mem))
            {
                return Err(DeviceError::InvalidState(format!(
                    "queue {i} does not fit the restored guest memory"
                )));
            }
            t.device.activate(t.acked_features);
            t.run(|dev, ctx| dev.restored(ctx));
        }
        if t.interrupt_status != 0 {
            t.raise_irq();
        }
        Ok(t)
    }

    fn raise_irq(&self) {
        if let Err(e) = self.irq.trigger() {
            tracing::warn!(gsi = self.irq.gsi(), error = %e, "irq trigger failed");
        }
    }

    /// Runs a device callback with its queues; interrupts on new used entries, marks the device
    /// as needing reset on error.
    fn run(&mut self, f: impl FnOnce(&mut D, &mut QueueCtx<'_>) -> Result<(), DeviceError>) {
        let mut ctx = QueueCtx::new(&self.mem, &mut self.queues);
        let res = f(&mut self.device, &mut ctx);
        let used = ctx.used_mask();
        if used != 0 {
            self.interrupt_status |= VIRTIO_MMIO_INT_VRING;
        }
        if let Err(e) = res {
            tracing::warn!(device = self.device.device_type(), error = %e,
                "virtio device needs reset");
            self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
            self.interrupt_status |= VIRTIO_MMIO_INT_CONFIG;
        }
        if used != 0 || self.needs_reset() {
            self.raise_irq();
        }
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Queue registers may change only between FEATURES_OK and DRIVER_OK, on a queue that is
    /// not yet ready (virtio 4.2.3.2).
    fn queue_config_allowed(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0
            && self.status & VIRTIO_CONFIG_S_DRIVER_OK == 0
            && self
                .queues
                .get(self.queue_sel as usize)
                .is_some_and(|q| !q.ready())
    }

    fn update_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if self.queue_config_allowed() {
            if let Some(q) = self.selected_queue() {
                f(q);
            }
        } else {
            tracing::debug!("ignored queue register write outside queue setup");
        }
    }

    fn reset(&mut self) {
        for q in &mut self.queues {
            q.reset();
        }
        self.device.reset();
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.queue_sel = 0;
        self.status = 0;
        self.interrupt_status = 0;
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        // The driver may not clear bits except by reset; NEEDS_RESET is the device's to set.
        let mut new = old | (v & !VIRTIO_CONFIG_S_NEEDS_RESET);
        if new & VIRTIO_CONFIG_S_FEATURES_OK != 0 && old & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            let offered = self.device.device_features();
            let ok = self.acked_features & !offered == 0
                && self.acked_features & (1 << VIRTIO_F_VERSION_1) != 0
                && old & VIRTIO_CONFIG_S_DRIVER != 0;
            if !ok {
                // Not setting FEATURES_OK tells the driver the subset is unusable (3.1.1).
                new &= !VIRTIO_CONFIG_S_FEATURES_OK;
            }
        }
        let activating =
            new & VIRTIO_CONFIG_S_DRIVER_OK != 0 && old & VIRTIO_CONFIG_S_DRIVER_OK == 0;
        if activating && new & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            new &= !VIRTIO_CONFIG_S_DRIVER_OK;
        }
        self.status = new;
        if activating && new & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            let bad = self
                .queues
                .iter()
                .position(|q| q.ready() && !q.is_valid(&self.mem));
            if let Some(i) = bad {
                tracing::warn!(queue = i, "virtio queue invalid at DRIVER_OK");
                self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
                self.interrupt_status |= VIRTIO_MMIO_INT_CONFIG;
                self.raise_irq();
                return;
            }
            self.device.activate(self.acked_features);
            // Input may have arrived before the driver was ready.
            self.run(|dev, ctx| dev.process_backend(ctx));
        }
    }

    fn read_reg(&self, reg: u32) -> u32 {
        let q = self.queues.get(self.queue_sel as usize);
        match reg {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            VIRTIO_MMIO_VERSION => 2,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device.device_features() as u32,
                1 => (self.device.device_features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => q.map_or(0, |q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => q.map_or(0, |q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt_status,
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    fn write_reg(&mut self, reg: u32, v: u32) {
        match reg {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES => {
                // Features are fixed once FEATURES_OK is set.
                if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
                    match self.driver_features_sel {
                        0 => {
                            self.acked_features =
                                (self.acked_features & !0xffff_ffff) | u64::from(v)
                        }
                        1 => {
                            self.acked_features =
                                (self.acked_features & 0xffff_ffff) | (u64::from(v) << 32)
                        }
                        _ => {}
                    }
                }
            }
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = v,
            VIRTIO_MMIO_QUEUE_NUM => {
                let mut bad = false;
                self.update_queue(|q| {
                    bad = u16::try_from(v)
                        .map(|s| q.try_set_size(s))
                        .map_or(true, |r| r.is_err())
                });
                if bad {
                    self.fail("invalid queue size");
                }
            }
            VIRTIO_MMIO_QUEUE_READY => self.update_queue(|q| q.set_ready(v == 1)),
            VIRTIO_MMIO_QUEUE_DESC_LOW => {
                self.update_queue(|q| q.set_desc_table_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH => {
                self.update_queue(|q| q.set_desc_table_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => {
                self.update_queue(|q| q.set_avail_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                self.update_queue(|q| q.set_avail_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW => {
                self.update_queue(|q| q.set_used_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH => {
                self.update_queue(|q| q.set_used_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_NOTIFY => {
                let Ok(qi) = u16::try_from(v) else { return };
                if self.is_active() && usize::from(qi) < self.queues.len() {
                    self.run(|dev, ctx| dev.queue_notify(qi, ctx));
                    self.kick_backend();
                }
            }
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt_status &= !v,
            VIRTIO_MMIO_STATUS => {
                self.set_status(v);
                self.kick_backend();
            }
            _ => tracing::debug!(reg, "write to unknown virtio-mmio register"),
        }
    }

    fn fail(&mut self, why: &str) {
        tracing::warn!(
            device = self.device.device_type(),
            why,
            "virtio driver error"
        );
        self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        self.interrupt_status |= VIRTIO_MMIO_INT_CONFIG;
        self.raise_irq();
    }
}

impl<D: VirtioDevice> BusDevice for MmioTransport<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device
                .read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        data.fill(0);
        // Registers are 32-bit and must be accessed as such (4.2.2.2).
        if data.len() == 4 && offset.is_multiple_of(4) {
            data.copy_from_slice(&self.read_reg(offset as u32).to_le_bytes());
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device
                .write_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        if let (Ok(bytes), true) = (<[u8; 4]>::try_from(data), offset.is_multiple_of(4)) {
            self.write_reg(offset as u32, u32::from_le_bytes(bytes));
        }
    }
}
