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
//! * [`GuestKind::Linux`]: a PVH vmlinux with cube-agent as init on the template's disk; ready
//!   once the agent asks for its init payload.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{Block, Net, Vsock, MMIO_WINDOW_SIZE};
use cube_hypervisor::{test_guests, RunOutcome, Shape, Vm, Vmm};

use crate::devices::{Devices, VSOCK_MMIO_BASE};

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
/// Largest init payload the stand-in accepts: one init frame (one rx buffer minus the vsock
/// header), as the init contract defines it.
pub const STANDIN_MAX_INIT: usize = cube_init::MAX_VSOCK_FRAME;

/// The shim's own guests (`guests/*.asm`), assembled by `build.rs`.
pub mod guests {
    include!(concat!(env!("OUT_DIR"), "/shim_guests.rs"));
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GuestKind {
    AgentStandin,
    /// A Linux kernel whose init is cube-agent: ready once the agent asks for its init
    /// payload over vsock (see `cube-agent/src/vsock_init.rs`).
    Linux(LinuxBoot),
}

/// What a Linux template build boots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinuxBoot {
    /// A PVH `vmlinux` (or bzImage).
    pub kernel: std::path::PathBuf,
    /// The template's own arguments (root device, init, quiet...); the device list, the init
    /// channel and host workarounds are appended by [`linux_cmdline`].
    pub cmdline: String,
    pub initramfs: Option<std::path::PathBuf>,
    /// Guest console output (the build's log), if wanted.
    pub console: Option<std::path::PathBuf>,
}

/// Kernel arguments a PVM host needs (its KVM emulates guest kernel mode for kernels that are
/// not PVM-enlightened, and that emulator cannot execute CMPXCHG16B, POPCNT, XSAVE/XRSTOR,
/// CLAC/STAC, INT3 or VMCALL): hide those features, skip the one driver that makes a
/// hypercall whatever KVM offers (`ptp_kvm`; the VMM offers no other paravirtual feature than
/// the clock there, see `cube_hypervisor::arch::PVM_KVM_FEATURES`), and turn on the guest
/// kernel's `cube_pvm` patch (deploy/guest-kernel/patches/).
pub const PVM_CMDLINE: &str =
    "cube_pvm clearcpuid=cx16,popcnt,smap noxsave initcall_blacklist=ptp_kvm_init";

/// The full command line of a Linux template: the template's arguments, one
/// `virtio_mmio.device=` per attached device, the init channel port, and on PVM hosts
/// [`PVM_CMDLINE`].
pub fn linux_cmdline(base: &str, devices: &[(u64, u32)], pvm: bool) -> String {
    let mut c = base.trim().to_string();
    for (addr, gsi) in devices {
        c.push_str(&format!(
            " virtio_mmio.device={}K@{addr:#x}:{gsi}",
            MMIO_WINDOW_SIZE / 1024
        ));
    }
    c.push_str(&format!(" cube.vsock_init={STANDIN_INIT_PORT}"));
    if pvm {
        c.push(' ');
        c.push_str(PVM_CMDLINE);
    }
    c
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
    /// The template's disk image, attached as virtio-blk ([`open_disk`]: a jailed build opens
    /// it before it drops its privileges).
    pub disk: Option<std::fs::File>,
    /// Attach a virtio-net device with this guest MAC.
    pub net_mac: Option<[u8; 6]>,
    /// Most time the guest may take to become ready.
    pub timeout: Duration,
    /// Where the build's vsock sockets go (a private directory is made inside it); the temp
    /// dir when `None`. A jailed build has no /tmp: cubelet passes its work directory.
    pub scratch: Option<&'a Path>,
}

/// Opens a template's disk for a build of `kind`: a Linux guest mounts its root read-write
/// (the build works on the copy that sandboxes are later cloned from, so disk and memory stay
/// consistent); the stand-in never writes it.
pub fn open_disk(path: &Path, kind: &GuestKind) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(matches!(kind, GuestKind::Linux(_)))
        .open(path)
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

/// Boots the guest, waits for its ready point and snapshots it into `out` (which must not
/// exist; it is written atomically by the hypervisor's snapshot code).
pub fn build(spec: BuildSpec<'_>, out: &Path) -> Result<cube_hypervisor::Manifest, BuildError> {
    build_with(&Vmm::new()?, spec, out, &mut || Ok(()))
}

/// [`build`] on an open KVM. `before_guest_runs` is called once the VM, its devices and its
/// kernel are set up, just before the guest's first instruction: the shim installs its
/// seccomp filter there, so hostile guest code meets a filtered VMM.
pub fn build_with(
    vmm: &Vmm,
    spec: BuildSpec<'_>,
    out: &Path,
    before_guest_runs: &mut dyn FnMut() -> Result<(), BuildError>,
) -> Result<cube_hypervisor::Manifest, BuildError> {
    let mut vm = vmm.create_vm(spec.shape)?;
    let linux = match &spec.kind {
        GuestKind::AgentStandin => {
            vm.load_test_guest(guests::AGENT_STANDIN)?;
            vm.write_u64(test_guests::PARAMS_ADDR, VSOCK_MMIO_BASE)?;
            vm.write_u64(test_guests::PARAMS_ADDR + 8, u64::from(STANDIN_INIT_PORT))?;
            mask_pic(&vm)?;
            None
        }
        GuestKind::Linux(boot) => Some(boot),
    };
    // The build's vsock socket lives in a private scratch dir under the temp dir: template dirs
    // can be deeper than a unix socket path allows (108 bytes).
    let sock_dir = scratch_dir(spec.scratch)?;
    let disk = match spec.disk {
        Some(f) => Some(Block::new(f, false, "rootfs")?),
        None => None,
    };
    let mut _net_peer = None;
    let net = match spec.net_mac {
        Some(mac) => {
            let mut fds = [0; 2];
            // SAFETY: socketpair fills the two-element array.
            let r = unsafe {
                libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr())
            };
            if r != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            // SAFETY: fresh fds, owned here. The build has no tap: a socket pair carries no
            // frames.
            let (dev_end, peer) =
                unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            _net_peer = Some(peer);
            Some(Net::new(dev_end, mac)?)
        }
        None => None,
    };
    let vsock =
        Vsock::new(GUEST_CID, &sock_dir.path().join("v.sock")).map_err(dev_err("virtio-vsock"))?;
    let devices =
        Devices::build(&mut vm, disk, net, vsock).map_err(|e| BuildError::Device(e.message))?;
    // Held until the snapshot is written: the agent must not see its request answered or closed.
    let mut _ready_conn = None;
    if let Some(boot) = linux {
        let mmio: Vec<(u64, u32)> = devices.slots().iter().map(|s| (s.base, s.gsi)).collect();
        let listener = std::os::unix::net::UnixListener::bind(
            sock_dir.path().join(format!("v.sock_{STANDIN_INIT_PORT}")),
        )?;
        _ready_conn = Some(boot_linux(
            &mut vm,
            boot,
            &linux_cmdline(&boot.cmdline, &mmio, vmm.is_pvm()),
            &listener,
            spec.timeout,
            before_guest_runs,
        )?);
    } else {
        before_guest_runs()?;
        let report = vm.run_until(spec.timeout)?;
        if report.outcome != RunOutcome::PausePoint(STANDIN_READY) {
            return Err(BuildError::NotReady(format!(
                "{:?}, checkpoints {:x?}",
                report.outcome, report.checkpoints
            )));
        }
    }
    if !devices.vsock_active() {
        return Err(BuildError::NotReady("vsock device not active".into()));
    }
    let states = devices
        .states()
        .map_err(|e| BuildError::Device(e.message))?;
    Ok(vm.snapshot(out, &states)?)
}

/// Boots `boot` with `cmdline` and runs it until cube-agent connects to `listener` (the init
/// channel) and says `redy`, then pauses the VM. Returns that connection (still open).
fn boot_linux(
    vm: &mut Vm,
    boot: &LinuxBoot,
    cmdline: &str,
    listener: &std::os::unix::net::UnixListener,
    timeout: Duration,
    before_guest_runs: &mut dyn FnMut() -> Result<(), BuildError>,
) -> Result<std::os::unix::net::UnixStream, BuildError> {
    use cube_hypervisor::devices::legacy::{
        I8042, I8042_PORT_BASE, I8042_PORT_LEN, SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN,
    };
    use std::io::Read;
    // Console and reset controller for the build only: restored copies have neither (the
    // agent logs to the kernel log, whose console writes are polled, so a missing UART is
    // harmless there).
    let console: Box<dyn std::io::Write + Send> = match &boot.console {
        Some(p) => Box::new(std::fs::File::create(p)?),
        None => Box::new(std::io::sink()),
    };
    let irq = IrqLine::new(SERIAL_GSI)?;
    vm.register_irq(&irq)?;
    vm.add_pio_device(
        SERIAL_PORT_BASE,
        SERIAL_PORT_LEN,
        Arc::new(Mutex::new(cube_hypervisor::devices::legacy::Serial::new(
            irq, console,
        ))),
    )?;
    let i8042 = I8042::new().map_err(|e| BuildError::Device(format!("i8042: {e}")))?;
    let reset = i8042.reset_evt().try_clone()?;
    vm.add_pio_device(I8042_PORT_BASE, I8042_PORT_LEN, Arc::new(Mutex::new(i8042)))?;
    vm.load_kernel(&cube_hypervisor::loader::KernelConfig {
        kernel: boot.kernel.clone(),
        cmdline: cmdline.to_string(),
        initramfs: boot.initramfs.clone(),
    })?;
    listener.set_nonblocking(true)?;
    before_guest_runs()?;
    let deadline = std::time::Instant::now() + timeout;
    vm.resume()?;
    let result = loop {
        if std::time::Instant::now() >= deadline {
            break Err(BuildError::NotReady(format!(
                "cube-agent did not ask for its init within {timeout:?}"
            )));
        }
        if reset.read().is_ok() {
            break Err(BuildError::NotReady(
                "the guest reset itself (kernel panic?)".into(),
            ));
        }
        match vm.next_event(Duration::from_millis(20))? {
            Some((id, cube_hypervisor::VcpuEvent::Error(e))) => {
                break Err(BuildError::NotReady(format!("vCPU {id}: {e}")))
            }
            Some((_, cube_hypervisor::VcpuEvent::Shutdown)) => {
                break Err(BuildError::NotReady("the guest shut down".into()))
            }
            _ => {}
        }
        match listener.accept() {
            Ok((mut c, _)) => {
                c.set_nonblocking(false)?;
                c.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut hello = [0u8; 4];
                match c.read_exact(&mut hello) {
                    Ok(()) if &hello == b"redy" => break Ok(c),
                    Ok(()) => tracing::warn!(?hello, "unexpected init hello during build"),
                    Err(e) => tracing::warn!("init connection during build: {e}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => break Err(e.into()),
        }
    };
    vm.pause()?;
    result
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

fn scratch_dir(parent: Option<&Path>) -> Result<ScratchDir, BuildError> {
    let d = match parent {
        // Short: the parent may already be deep (a unix socket path has 108 bytes).
        Some(p) => p.join("vs"),
        None => std::env::temp_dir().join(format!("cube-shim-{}-{}", std::process::id(), nanos())),
    };
    std::fs::create_dir_all(&d)?;
    Ok(ScratchDir(d))
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
