//! Template builds: boot a guest once, wait until it says it is ready, snapshot it into a
//! directory in the layout the shim restores ([`crate::devices`]).
//!
//! Kinds of guest:
//! * [`GuestKind::AgentStandin`]: the shim's `agent_standin` test guest (see
//!   `guests/agent_standin.asm`). It stands in for cube-agent on hosts where Linux cannot boot
//!   (PVM): it drives virtio-vsock, stops at its "ready" pause point (the snapshot is taken
//!   there), and after every restore asks the host for its init payload over vsock port
//!   [`STANDIN_INIT_PORT`]. The template also carries a virtio-blk device on the template's disk
//!   and a virtio-net device, which the stand-in does not drive (a real guest would), so
//!   restores exercise the disk and tap plumbing.
//! * Linux (a PVH vmlinux + rootfs with cube-agent as init) needs hardware KVM; this build
//!   refuses it with a clear error (see `deploy/guest-kernel/linux-e2e.sh` for that path).

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{Block, MmioTransport, Net, Vsock, MMIO_WINDOW_SIZE};
use cube_hypervisor::{test_guests, DeviceStates, RunOutcome, Shape, Vm, Vmm};

use crate::devices::{
    BLOCK_GSI, BLOCK_MMIO_BASE, BLOCK_NAME, NET_GSI, NET_MMIO_BASE, NET_NAME, VSOCK_GSI,
    VSOCK_MMIO_BASE, VSOCK_NAME,
};

/// Host (CID 2) vsock port the stand-in guest connects to for its init payload.
pub const STANDIN_INIT_PORT: u32 = 1024;
/// Guest CID of every sandbox (the same in every copy of a template).
pub const GUEST_CID: u64 = 3;
/// Pause point value the stand-in reports when ready to be snapshotted.
pub const STANDIN_READY: u32 = 0xa9e7;
/// Checkpoint the stand-in reports once an init payload was applied.
pub const STANDIN_INIT_DONE: u32 = 0xd0e;
/// Checkpoint the stand-in reports when a resume / restore woke it from idle.
pub const STANDIN_WOKEN: u32 = 0x77;
/// Guest address of the last init payload the stand-in received, and of its length.
pub const STANDIN_INIT_DATA: u64 = 0x241000 + 44;
pub const STANDIN_INIT_LEN: u64 = 0x241000 + 24;
/// Largest init payload the stand-in accepts (one rx buffer minus the vsock header).
pub const STANDIN_MAX_INIT: usize = 4096 - 44;

/// The shim's own guests (`guests/*.asm`), assembled by `build.rs`.
pub mod guests {
    include!(concat!(env!("OUT_DIR"), "/shim_guests.rs"));
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestKind {
    AgentStandin,
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("template build: {0}")]
    Hypervisor(#[from] cube_hypervisor::Error),
    #[error("template build: {0}")]
    Io(#[from] std::io::Error),
    #[error("template build: the guest did not become ready: {0}")]
    NotReady(String),
    #[error("template build: {0}")]
    Device(String),
}

/// What a template build needs.
pub struct BuildSpec<'a> {
    pub kind: GuestKind,
    pub shape: Shape,
    /// The template's disk image, attached as virtio-blk (opened read-only for the build).
    pub disk: Option<&'a Path>,
    /// Attach a virtio-net device with this guest MAC.
    pub net_mac: Option<[u8; 6]>,
    /// Most time the guest may take to become ready.
    pub timeout: Duration,
}

/// These polling guests have an empty IDT: mask the PIC as a real guest's interrupt setup
/// would, so that device interrupts stay pending instead of being delivered.
fn mask_pic(vm: &Vm) -> Result<(), BuildError> {
    let mut pic = kvm_bindings::kvm_irqchip {
        chip_id: kvm_bindings::KVM_IRQCHIP_PIC_MASTER,
        ..Default::default()
    };
    vm.vm_fd()
        .get_irqchip(&mut pic)
        .map_err(|e| BuildError::Device(format!("get PIC: {e}")))?;
    // Writing a union field is safe; KVM filled the PIC variant for this chip id.
    pic.chip.pic.imr = 0xff;
    vm.vm_fd()
        .set_irqchip(&pic)
        .map_err(|e| BuildError::Device(format!("set PIC: {e}")))?;
    Ok(())
}

fn dev_err(
    what: &str,
) -> impl FnOnce(cube_hypervisor::devices::virtio::DeviceError) -> BuildError + '_ {
    move |e| BuildError::Device(format!("{what}: {e}"))
}

/// Serializes one device's state when the guest is ready.
type StateFn = Box<dyn Fn() -> Result<Vec<u8>, BuildError>>;

/// Boots the guest, waits for its ready point and snapshots it into `out` (which must not
/// exist; it is written atomically by the hypervisor's snapshot code).
pub fn build(spec: &BuildSpec<'_>, out: &Path) -> Result<cube_hypervisor::Manifest, BuildError> {
    let GuestKind::AgentStandin = spec.kind;
    let vmm = Vmm::new()?;
    let mut vm = vmm.create_vm(spec.shape)?;
    vm.load_test_guest(guests::AGENT_STANDIN)?;
    vm.write_u64(test_guests::PARAMS_ADDR, VSOCK_MMIO_BASE)?;
    vm.write_u64(test_guests::PARAMS_ADDR + 8, u64::from(STANDIN_INIT_PORT))?;
    mask_pic(&vm)?;
    let mut devices = DeviceStates::new();
    let mut states: Vec<(&str, StateFn)> = Vec::new();
    // The build's vsock socket lives in a private scratch dir under the temp dir: template dirs
    // can be deeper than a unix socket path allows (108 bytes).
    let sock_dir = scratch_dir()?;
    if let Some(disk) = spec.disk {
        let f = std::fs::File::open(disk)?;
        let irq = IrqLine::new(BLOCK_GSI)?;
        vm.register_irq(&irq)?;
        let t = MmioTransport::new(Block::new(f, false, "rootfs")?, vm.memory().clone(), irq)
            .map_err(dev_err("virtio-blk"))?;
        let t = Arc::new(Mutex::new(t));
        vm.add_mmio_device(BLOCK_MMIO_BASE, MMIO_WINDOW_SIZE, t.clone())?;
        states.push((BLOCK_NAME, Box::new(move || encode(&t))));
    }
    let mut _net_peer = None;
    if let Some(mac) = spec.net_mac {
        let mut fds = [0; 2];
        // SAFETY: socketpair fills the two-element array.
        let r =
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr()) };
        if r != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: fresh fds, owned here. The build has no tap: a socket pair carries no frames.
        let (dev_end, peer) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        _net_peer = Some(peer);
        let irq = IrqLine::new(NET_GSI)?;
        vm.register_irq(&irq)?;
        let t = MmioTransport::new(Net::new(dev_end, mac)?, vm.memory().clone(), irq)
            .map_err(dev_err("virtio-net"))?;
        let t = Arc::new(Mutex::new(t));
        vm.add_mmio_device(NET_MMIO_BASE, MMIO_WINDOW_SIZE, t.clone())?;
        states.push((NET_NAME, Box::new(move || encode(&t))));
    }
    let irq = IrqLine::new(VSOCK_GSI)?;
    vm.register_irq(&irq)?;
    let vs = MmioTransport::new(
        Vsock::new(GUEST_CID, &sock_dir.path().join("v.sock")).map_err(dev_err("virtio-vsock"))?,
        vm.memory().clone(),
        irq,
    )
    .map_err(dev_err("virtio-vsock"))?;
    let vs = Arc::new(Mutex::new(vs));
    vm.add_mmio_device(VSOCK_MMIO_BASE, MMIO_WINDOW_SIZE, vs.clone())?;
    let report = vm.run_until(spec.timeout)?;
    if report.outcome != RunOutcome::PausePoint(STANDIN_READY) {
        return Err(BuildError::NotReady(format!(
            "{:?}, checkpoints {:x?}",
            report.outcome, report.checkpoints
        )));
    }
    if !vs.lock().unwrap_or_else(|e| e.into_inner()).is_active() {
        return Err(BuildError::NotReady("vsock device not active".into()));
    }
    devices.insert(VSOCK_NAME.into(), encode(&vs)?);
    for (name, f) in &states {
        devices.insert((*name).into(), f()?);
    }
    Ok(vm.snapshot(out, &devices)?)
}

fn encode<D: cube_hypervisor::devices::virtio::VirtioDevice>(
    t: &Arc<Mutex<MmioTransport<D>>>,
) -> Result<Vec<u8>, BuildError>
where
    D::State: serde::Serialize,
{
    serde_json::to_vec(&t.lock().unwrap_or_else(|e| e.into_inner()).state())
        .map_err(|e| BuildError::Device(format!("encode device state: {e}")))
}

/// A private scratch directory with a short path (for unix sockets).
struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch_dir() -> Result<ScratchDir, BuildError> {
    let d = std::env::temp_dir().join(format!("cube-shim-{}-{}", std::process::id(), nanos()));
    std::fs::create_dir_all(&d)?;
    Ok(ScratchDir(d))
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
