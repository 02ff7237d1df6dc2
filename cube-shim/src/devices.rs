//! The sandbox's devices and the machine layout a template must follow for the shim to
//! rebuild them: each device's state is stored in the snapshot under its name
//! ([`cube_hypervisor::DeviceStates`]) and comes back at a fixed MMIO window and GSI.
//!
//! | name          | MMIO window   | GSI | backend on restore          |
//! |---------------|---------------|-----|-----------------------------|
//! | `virtio-blk`  | `0xc000_0000` | 5   | `disk` (file, read-write)   |
//!
//! `virtio-net` (tap) and `virtio-vsock` (host socket) are not rebuilt yet: a snapshot
//! carrying them is refused with `unsupported`.

use std::path::Path;
use std::sync::{Arc, Mutex};

use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{
    Block, BlockState, MmioState, MmioTransport, MMIO_WINDOW_SIZE,
};
use cube_hypervisor::{DeviceStates, Snapshot, Vm};

use crate::protocol::{ErrorKind, ErrorReply};

pub const BLOCK_NAME: &str = "virtio-blk";
pub const BLOCK_MMIO_BASE: u64 = 0xc000_0000;
pub const BLOCK_GSI: u32 = 5;

/// Devices attached to the running VM (kept to save their state in snapshots).
#[derive(Default)]
pub struct Devices {
    block: Option<Arc<Mutex<MmioTransport<Block>>>>,
}

fn bad(kind: ErrorKind, msg: impl Into<String>) -> ErrorReply {
    ErrorReply::new(kind, msg)
}

/// Backends opened for a restore.
pub struct Backends {
    disk: Option<std::fs::File>,
}

/// Checks that the snapshot's devices and the backends named in the request match and opens
/// the backends, before the shell is spent on the restore.
pub fn open_backends(snap: &Snapshot, disk: Option<&Path>) -> Result<Backends, ErrorReply> {
    for name in snap.state().devices.keys() {
        if name != BLOCK_NAME {
            return Err(bad(
                ErrorKind::Unsupported,
                format!("snapshot has device {name:?}, which this shim cannot rebuild yet"),
            ));
        }
    }
    let disk = match (snap.device_state(BLOCK_NAME).is_some(), disk) {
        (true, None) => {
            return Err(bad(
                ErrorKind::BadRequest,
                "the snapshot has a virtio-blk device: the request must name its `disk`",
            ))
        }
        (false, Some(d)) => {
            return Err(bad(
                ErrorKind::BadRequest,
                format!(
                    "`disk` {} given but the snapshot has no virtio-blk device",
                    d.display()
                ),
            ))
        }
        (true, Some(d)) => Some(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(d)
                .map_err(|e| {
                    bad(
                        ErrorKind::BadRequest,
                        format!("open disk {}: {e}", d.display()),
                    )
                })?,
        ),
        (false, None) => None,
    };
    Ok(Backends { disk })
}

impl Devices {
    /// Rebuilds the snapshot's devices on the backends from [`open_backends`] and attaches them
    /// to `vm` (paused, just restored).
    pub fn restore(
        snap: &Snapshot,
        vm: &mut Vm,
        backends: Backends,
    ) -> Result<Devices, ErrorReply> {
        let mut d = Devices::default();
        if let (Some(bytes), Some(file)) = (snap.device_state(BLOCK_NAME), backends.disk) {
            let state: MmioState<BlockState> = serde_json::from_slice(bytes).map_err(|e| {
                bad(
                    ErrorKind::Snapshot,
                    format!("virtio-blk state in the snapshot: {e}"),
                )
            })?;
            let irq = IrqLine::new(BLOCK_GSI)
                .map_err(|e| bad(ErrorKind::Internal, format!("eventfd: {e}")))?;
            vm.register_irq(&irq)
                .map_err(|e| bad(ErrorKind::Internal, e.to_string()))?;
            let t = MmioTransport::<Block>::restore(state, file, vm.memory().clone(), irq)
                .map_err(|e| bad(ErrorKind::Snapshot, format!("virtio-blk restore: {e}")))?;
            let t = Arc::new(Mutex::new(t));
            vm.add_mmio_device(BLOCK_MMIO_BASE, MMIO_WINDOW_SIZE, t.clone())
                .map_err(|e| bad(ErrorKind::Internal, e.to_string()))?;
            d.block = Some(t);
        }
        Ok(d)
    }

    /// Device states for a snapshot (the vCPUs must be paused: block requests are handled on
    /// vCPU exits, so nothing is in progress then).
    pub fn states(&self) -> Result<DeviceStates, ErrorReply> {
        let mut out = DeviceStates::new();
        if let Some(b) = &self.block {
            let st = b.lock().unwrap_or_else(|e| e.into_inner()).state();
            let bytes = serde_json::to_vec(&st)
                .map_err(|e| bad(ErrorKind::Internal, format!("encode virtio-blk state: {e}")))?;
            out.insert(BLOCK_NAME.to_string(), bytes);
        }
        Ok(out)
    }
}
