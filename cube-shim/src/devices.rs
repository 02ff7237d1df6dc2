//! The sandbox's devices and the machine layout a template must follow for the shim to
//! rebuild them: each device's state is stored in the snapshot under its name
//! ([`cube_hypervisor::DeviceStates`]) and comes back at a fixed MMIO window and GSI.
//!
//! | name           | MMIO window   | GSI | backend on restore / resume                     |
//! |----------------|---------------|-----|-------------------------------------------------|
//! | `virtio-blk`   | `0xc000_0000` | 5   | `disk` (file, read-write)                       |
//! | `virtio-net`   | `0xc000_1000` | 6   | `tap` (interface name, opened `IFF_TAP\|IFF_NO_PI`) |
//! | `virtio-vsock` | `0xc000_2000` | 7   | `vsock` (host unix socket path, bound by the shim) |
//!
//! Every device is optional; a snapshot's devices and the request's backends must match one
//! to one. The net and vsock devices get a [`BackendWorker`] thread that moves host input
//! (tap frames, host connections) into the guest; it is parked while the VM is paused,
//! snapshotted or paused to disk, so device state is taken while nothing touches it.
//!
//! The tap carries bare ethernet frames (no `IFF_VNET_HDR`): the net device offers no
//! offloads and writes/reads one frame per `write`/`read`, adding and stripping the
//! `virtio_net_hdr` itself. Vsock connections are not carried across a snapshot (the guest
//! gets a transport reset); the guest CID and MAC are.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::virtio::{
    BackendWorker, Block, MmioState, MmioTransport, Net, VirtioDevice, Vsock, MMIO_WINDOW_SIZE,
};
use cube_hypervisor::{DeviceStates, Snapshot, Vm};

use crate::protocol::{ErrorKind, ErrorReply};

pub const BLOCK_NAME: &str = "virtio-blk";
pub const BLOCK_MMIO_BASE: u64 = 0xc000_0000;
pub const BLOCK_GSI: u32 = 5;

pub const NET_NAME: &str = "virtio-net";
pub const NET_MMIO_BASE: u64 = 0xc000_1000;
pub const NET_GSI: u32 = 6;

pub const VSOCK_NAME: &str = "virtio-vsock";
pub const VSOCK_MMIO_BASE: u64 = 0xc000_2000;
pub const VSOCK_GSI: u32 = 7;

/// Where a device sits in the machine: its name in snapshots, its MMIO window and its GSI. A
/// template fixes these; every restore puts the device back in the same place.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub name: &'static str,
    pub base: u64,
    pub gsi: u32,
}

pub const BLOCK: Slot = Slot {
    name: BLOCK_NAME,
    base: BLOCK_MMIO_BASE,
    gsi: BLOCK_GSI,
};
pub const NET: Slot = Slot {
    name: NET_NAME,
    base: NET_MMIO_BASE,
    gsi: NET_GSI,
};
pub const VSOCK: Slot = Slot {
    name: VSOCK_NAME,
    base: VSOCK_MMIO_BASE,
    gsi: VSOCK_GSI,
};

/// Longest interface name the kernel accepts (`IFNAMSIZ` − 1).
const MAX_IFNAME: usize = 15;
/// `sun_path` size: the vsock socket path (and `<path>_<port>`) must fit in it.
const MAX_SOCKET_PATH: usize = 108;

/// Devices attached to the running VM (kept to save their state in snapshots).
///
/// Field order matters: the workers are dropped (stopped and joined) before the transports.
#[derive(Default)]
pub struct Devices {
    workers: Vec<BackendWorker>,
    block: Option<Arc<Mutex<MmioTransport<Block>>>>,
    net: Option<Arc<Mutex<MmioTransport<Net>>>>,
    vsock: Option<Arc<Mutex<MmioTransport<Vsock>>>>,
}

fn bad(kind: ErrorKind, msg: impl Into<String>) -> ErrorReply {
    ErrorReply::new(kind, msg)
}

/// Backends named in a restore / resume request.
#[derive(Clone, Copy, Debug, Default)]
pub struct BackendNames<'a> {
    pub disk: Option<&'a Path>,
    pub tap: Option<&'a str>,
    pub vsock: Option<&'a Path>,
}

/// Backends opened for a restore.
pub struct Backends {
    disk: Option<std::fs::File>,
    tap: Option<OwnedFd>,
    vsock: Option<PathBuf>,
}

/// Checks that device `name` is in the snapshot exactly when its backend is named.
fn pair<'a, T: ?Sized>(
    snap: &Snapshot,
    name: &str,
    field: &str,
    given: Option<&'a T>,
    show: impl Fn(&T) -> String,
) -> Result<Option<&'a T>, ErrorReply> {
    match (snap.device_state(name).is_some(), given) {
        (true, None) => Err(bad(
            ErrorKind::BadRequest,
            format!("the snapshot has a {name} device: the request must name its `{field}`"),
        )),
        (false, Some(g)) => Err(bad(
            ErrorKind::BadRequest,
            format!(
                "`{field}` {} given but the snapshot has no {name} device",
                show(g)
            ),
        )),
        (_, g) => Ok(g),
    }
}

/// Opens tap interface `name` (which cubelet created, persistent: `ip tuntap add`) for bare
/// ethernet frames.
pub fn open_tap(name: &str) -> Result<OwnedFd, ErrorReply> {
    if name.is_empty()
        || name.len() > MAX_IFNAME
        || name
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || b == 0)
        || name == "."
        || name == ".."
    {
        return Err(bad(
            ErrorKind::BadRequest,
            format!("invalid tap interface name {name:?}"),
        ));
    }
    // SAFETY: the path is a valid NUL-terminated string.
    let fd = unsafe {
        libc::open(
            c"/dev/net/tun".as_ptr(),
            libc::O_RDWR | libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    };
    if fd < 0 {
        return Err(bad(
            ErrorKind::Internal,
            format!("open /dev/net/tun: {}", std::io::Error::last_os_error()),
        ));
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; zeroed is valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // No IFF_VNET_HDR: the device reads and writes bare frames (see the module docs).
    ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // EBUSY can be transient: cubelet attaches to the tap for a moment to hand it to this
    // shim (TUNSETOWNER), and a process it forks meanwhile holds that fd until its exec.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        // SAFETY: TUNSETIFF reads a valid ifreq; the fd is a tun control fd.
        let r = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::TUNSETIFF as _,
                &mut ifr,
            )
        };
        if r >= 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) || std::time::Instant::now() >= deadline {
            return Err(bad(
                ErrorKind::BadRequest,
                format!("attach to tap {name:?}: {e}"),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // TUNSETIFF creates a missing interface instead of failing: a tap cubelet made is
    // persistent, one we just made is not (and goes away with `fd` here).
    // SAFETY: TUNGETIFF fills a valid ifreq.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::TUNGETIFF as _,
            &mut ifr,
        )
    };
    // SAFETY: TUNGETIFF set the flags variant of the union.
    let flags = i32::from(unsafe { ifr.ifr_ifru.ifru_flags });
    if r < 0 || flags & libc::IFF_PERSIST == 0 {
        return Err(bad(
            ErrorKind::BadRequest,
            format!("no tap interface {name:?} (the sandbox's tap must exist, persistent)"),
        ));
    }
    Ok(fd)
}

/// Checks that the snapshot's devices and the backends named in the request match and opens
/// the backends, before the shell is spent on the restore.
pub fn open_backends(snap: &Snapshot, names: BackendNames<'_>) -> Result<Backends, ErrorReply> {
    for name in snap.state().devices.keys() {
        if ![BLOCK_NAME, NET_NAME, VSOCK_NAME].contains(&name.as_str()) {
            return Err(bad(
                ErrorKind::Unsupported,
                format!("snapshot has device {name:?}, which this shim cannot rebuild"),
            ));
        }
    }
    let disk = pair(snap, BLOCK_NAME, "disk", names.disk, |d| {
        d.display().to_string()
    })?;
    let tap = pair(snap, NET_NAME, "tap", names.tap, |t| format!("{t:?}"))?;
    let vsock = pair(snap, VSOCK_NAME, "vsock", names.vsock, |v| {
        v.display().to_string()
    })?;
    if let Some(v) = vsock {
        // Checked here, before the shell is spent: the device binds the socket during restore.
        let parent_is_dir = v
            .parent()
            .map(|p| p.as_os_str().is_empty() || p.is_dir())
            .unwrap_or(false);
        if v.file_name().is_none()
            || v.as_os_str().len() >= MAX_SOCKET_PATH
            || !parent_is_dir
            || v.is_dir()
        {
            return Err(bad(
                ErrorKind::BadRequest,
                format!(
                    "invalid vsock socket path {} (a new file in an existing directory, under {MAX_SOCKET_PATH} bytes)",
                    v.display()
                ),
            ));
        }
    }
    let disk = match disk {
        Some(d) => Some(
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
        None => None,
    };
    let tap = tap.map(open_tap).transpose()?;
    Ok(Backends {
        disk,
        tap,
        vsock: vsock.map(Path::to_path_buf),
    })
}

/// How a device comes into a VM: made new (a template build), or rebuilt from a snapshot's
/// saved state on a new backend (restore, resume). Both go through [`plug`], so a restored
/// machine is put together exactly as its template was.
enum Origin<'a, D: VirtioDevice> {
    New(D),
    Saved(&'a Snapshot, D::Backend),
}

/// Puts a device into `vm` at `slot`: its interrupt line, its transport, its MMIO window.
fn plug<D: VirtioDevice>(
    vm: &mut Vm,
    slot: Slot,
    origin: Origin<'_, D>,
) -> Result<Arc<Mutex<MmioTransport<D>>>, ErrorReply> {
    let name = slot.name;
    let irq =
        IrqLine::new(slot.gsi).map_err(|e| bad(ErrorKind::Internal, format!("eventfd: {e}")))?;
    vm.register_irq(&irq)
        .map_err(|e| bad(ErrorKind::Internal, e.to_string()))?;
    let t = match origin {
        Origin::New(dev) => MmioTransport::new(dev, vm.memory().clone(), irq)
            .map_err(|e| bad(ErrorKind::Internal, format!("{name}: {e}")))?,
        Origin::Saved(snap, backend) => {
            let bytes = snap
                .device_state(name)
                .ok_or_else(|| bad(ErrorKind::Internal, format!("{name} state vanished")))?;
            let state: MmioState<D::State> = serde_json::from_slice(bytes).map_err(|e| {
                bad(
                    ErrorKind::Snapshot,
                    format!("{name} state in the snapshot: {e}"),
                )
            })?;
            MmioTransport::<D>::restore(state, backend, vm.memory().clone(), irq)
                .map_err(|e| bad(ErrorKind::Snapshot, format!("{name} restore: {e}")))?
        }
    };
    let t = Arc::new(Mutex::new(t));
    vm.add_mmio_device(slot.base, MMIO_WINDOW_SIZE, t.clone())
        .map_err(|e| bad(ErrorKind::Internal, e.to_string()))?;
    Ok(t)
}

fn encode<D: VirtioDevice>(
    out: &mut DeviceStates,
    name: &str,
    t: &Option<Arc<Mutex<MmioTransport<D>>>>,
) -> Result<(), ErrorReply> {
    if let Some(t) = t {
        let st = t.lock().unwrap_or_else(|e| e.into_inner()).state();
        let bytes = serde_json::to_vec(&st)
            .map_err(|e| bad(ErrorKind::Internal, format!("encode {name} state: {e}")))?;
        out.insert(name.to_string(), bytes);
    }
    Ok(())
}

impl Devices {
    /// Rebuilds the snapshot's devices on the backends from [`open_backends`] and attaches them
    /// to `vm` (paused, just restored). The backend workers start parked: [`Devices::resume`]
    /// lets them run with the vCPUs.
    pub fn restore(
        snap: &Snapshot,
        vm: &mut Vm,
        backends: Backends,
    ) -> Result<Devices, ErrorReply> {
        let mut d = Devices::default();
        if let Some(file) = backends.disk {
            d.block = Some(plug::<Block>(vm, BLOCK, Origin::Saved(snap, file))?);
        }
        if let Some(tap) = backends.tap {
            let t = plug::<Net>(vm, NET, Origin::Saved(snap, tap))?;
            d.workers.push(spawn_worker(t.clone())?);
            d.net = Some(t);
        }
        if let Some(path) = backends.vsock {
            let t = plug::<Vsock>(vm, VSOCK, Origin::Saved(snap, path))?;
            d.workers.push(spawn_worker(t.clone())?);
            d.vsock = Some(t);
        }
        Ok(d)
    }

    /// A template build's devices, made new in the same slots and order as a restore puts
    /// them: the disk and NIC when given, always vsock. No backend workers: a build's guest
    /// only calls out (its init request) and the host sends it nothing.
    pub fn build(
        vm: &mut Vm,
        disk: Option<Block>,
        net: Option<Net>,
        vsock: Vsock,
    ) -> Result<Devices, ErrorReply> {
        let mut d = Devices::default();
        if let Some(b) = disk {
            d.block = Some(plug(vm, BLOCK, Origin::New(b))?);
        }
        if let Some(n) = net {
            d.net = Some(plug(vm, NET, Origin::New(n))?);
        }
        d.vsock = Some(plug(vm, VSOCK, Origin::New(vsock))?);
        Ok(d)
    }

    /// The slots in use, in attach order (what a Linux guest's command line lists).
    pub fn slots(&self) -> Vec<Slot> {
        let mut v = Vec::new();
        if self.block.is_some() {
            v.push(BLOCK);
        }
        if self.net.is_some() {
            v.push(NET);
        }
        if self.vsock.is_some() {
            v.push(VSOCK);
        }
        v
    }

    /// Whether the guest's driver set the vsock device up (a ready guest has).
    pub fn vsock_active(&self) -> bool {
        self.vsock
            .as_ref()
            .is_some_and(|v| v.lock().unwrap_or_else(|e| e.into_inner()).is_active())
    }

    /// Parks the backend workers (returns once none touches its device).
    pub fn pause(&self) {
        for w in &self.workers {
            w.pause();
        }
    }

    /// Lets the backend workers run again.
    pub fn resume(&self) {
        for w in &self.workers {
            w.resume();
        }
    }

    /// Device states for a snapshot. The vCPUs and the workers must be paused ([`Devices::pause`]):
    /// guest requests are handled on vCPU exits and host input by the workers.
    pub fn states(&self) -> Result<DeviceStates, ErrorReply> {
        let mut out = DeviceStates::new();
        encode(&mut out, BLOCK_NAME, &self.block)?;
        encode(&mut out, NET_NAME, &self.net)?;
        encode(&mut out, VSOCK_NAME, &self.vsock)?;
        Ok(out)
    }
}

fn spawn_worker<D: VirtioDevice>(
    t: Arc<Mutex<MmioTransport<D>>>,
) -> Result<BackendWorker, ErrorReply> {
    // The VM is still paused: the worker stays off the device until it runs.
    BackendWorker::spawn_paused(t)
        .map_err(|e| bad(ErrorKind::Internal, format!("backend worker: {e}")))
}
