//! vCPU state capture/restore (Firecracker's order, see the notes) and the vCPU thread with its
//! kick protocol: a pause sets `kvm_run.immediate_exit` and sends a real-time signal, so
//! `KVM_RUN` returns `EINTR` whether the thread is inside the ioctl or about to enter it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};

use crate::devices::bus::Bus;
use crate::error::{Error, Result, SnapshotError};
use crate::test_guests::ports;
use crate::vstate::memory::GuestMemory;
use crate::vstate::xstate::{self, PvOp, PvXstate};

/// MSRs PVM adds that `KVM_GET_MSR_INDEX_LIST` does not report (see the notes §0).
pub const PVM_MSRS: [u32; 5] = [
    0x4b56_4df0,
    0x4b56_4df1,
    0x4b56_4df4,
    0x4b56_4df5,
    0x4b56_4df6,
];
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// Chunk size for KVM_GET/SET_MSRS.
const MSR_CHUNK: usize = 64;

/// Everything KVM holds for one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debug_regs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub tsc_khz: Option<u32>,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
}

fn ke(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    crate::error::kvm(op)
}

/// Reads the state of a paused vCPU. `msr_list` is the host's MSR index list (plus PVM MSRs).
pub fn save_state(fd: &VcpuFd, msr_list: &[u32]) -> Result<VcpuState> {
    // MP state first: KVM_GET_MP_STATE may process pending LAPIC events.
    let mp_state = fd.get_mp_state().map_err(ke("KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(ke("KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(ke("KVM_GET_SREGS"))?;
    let xsave = fd.get_xsave().map_err(ke("KVM_GET_XSAVE"))?;
    let xcrs = fd.get_xcrs().map_err(ke("KVM_GET_XCRS"))?;
    let debug_regs = fd.get_debug_regs().map_err(ke("KVM_GET_DEBUGREGS"))?;
    let lapic = fd.get_lapic().map_err(ke("KVM_GET_LAPIC"))?;
    let tsc_khz = fd.get_tsc_khz().ok();
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ke("KVM_GET_CPUID2"))?
        .as_slice()
        .iter()
        .filter(|e| e.function != 0 || e.index != 0 || e.eax != 0 || e.ebx != 0 || e.ecx != 0)
        .copied()
        .collect();
    // TSC_DEADLINE goes last so that on restore it is set after TSC.
    let mut order: Vec<u32> = msr_list
        .iter()
        .copied()
        .filter(|&m| m != MSR_IA32_TSC_DEADLINE)
        .collect();
    if msr_list.contains(&MSR_IA32_TSC_DEADLINE) {
        order.push(MSR_IA32_TSC_DEADLINE);
    }
    let mut msrs = Vec::with_capacity(order.len());
    for chunk in order.chunks(MSR_CHUNK) {
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut m = Msrs::from_entries(&entries).map_err(|e| Error::Vcpu {
            vcpu: 0,
            msg: format!("MSR list: {e:?}"),
        })?;
        let n = fd.get_msrs(&mut m).map_err(ke("KVM_GET_MSRS"))?;
        // KVM stops at the first MSR it cannot read; retry the rest one by one so that an
        // unreadable MSR (e.g. a PVM MSR before the guest enabled PVM mode) is skipped, not
        // the whole tail.
        msrs.extend_from_slice(&m.as_slice()[..n]);
        for &index in &chunk[n.min(chunk.len())..] {
            let mut one = Msrs::from_entries(&[kvm_msr_entry {
                index,
                ..Default::default()
            }])
            .map_err(|e| Error::Vcpu {
                vcpu: 0,
                msg: format!("MSR list: {e:?}"),
            })?;
            if fd.get_msrs(&mut one).map_err(ke("KVM_GET_MSRS"))? == 1 {
                msrs.push(one.as_slice()[0]);
            }
        }
    }
    // Events last: they are only consistent once every vCPU is paused.
    let vcpu_events = fd.get_vcpu_events().map_err(ke("KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debug_regs,
        lapic,
        tsc_khz,
        cpuid,
        msrs,
        vcpu_events,
    })
}

/// Writes a saved state into a vCPU, in the order KVM needs (see the notes §1.1).
pub fn restore_state(fd: &VcpuFd, s: &VcpuState) -> Result<()> {
    let rejected = |op: &str, e: kvm_ioctls::Error| Error::Snapshot {
        path: Default::default(),
        kind: SnapshotError::StateRejected(format!("{op}: {e}")),
    };
    let cpuid = CpuId::from_entries(&s.cpuid)
        .map_err(|e| rejected("cpuid", kvm_ioctls::Error::new(libc::EINVAL)).with_ctx(e))?;
    fd.set_cpuid2(&cpuid)
        .map_err(|e| rejected("KVM_SET_CPUID2", e))?;
    fd.set_mp_state(s.mp_state)
        .map_err(|e| rejected("KVM_SET_MP_STATE", e))?;
    fd.set_regs(&s.regs)
        .map_err(|e| rejected("KVM_SET_REGS", e))?;
    fd.set_sregs(&s.sregs)
        .map_err(|e| rejected("KVM_SET_SREGS", e))?;
    // SAFETY: kvm_xsave is the fixed 4 KiB layout that KVM_GET_XSAVE returned.
    unsafe { fd.set_xsave(&s.xsave) }.map_err(|e| rejected("KVM_SET_XSAVE", e))?;
    // A host without XSAVE saves no XCR (KVM_GET_XCRS answers an empty list) and refuses
    // KVM_SET_XCRS outright.
    if s.xcrs.nr_xcrs > 0 {
        fd.set_xcrs(&s.xcrs)
            .map_err(|e| rejected("KVM_SET_XCRS", e))?;
    }
    fd.set_debug_regs(&s.debug_regs)
        .map_err(|e| rejected("KVM_SET_DEBUGREGS", e))?;
    fd.set_lapic(&s.lapic)
        .map_err(|e| rejected("KVM_SET_LAPIC", e))?;
    let tsc = s
        .msrs
        .iter()
        .find(|m| m.index == MSR_IA32_TSC)
        .map(|m| m.data);
    for chunk in s.msrs.chunks(MSR_CHUNK) {
        let mut entries = chunk.to_vec();
        // A zero deadline would lose a pending timer on restore (FC does the same).
        for e in entries.iter_mut() {
            if e.index == MSR_IA32_TSC_DEADLINE && e.data == 0 {
                if let Some(t) = tsc {
                    e.data = t;
                }
            }
        }
        let m = Msrs::from_entries(&entries)
            .map_err(|e| rejected("msrs", kvm_ioctls::Error::new(libc::EINVAL)).with_ctx(e))?;
        let n = fd.set_msrs(&m).map_err(|e| rejected("KVM_SET_MSRS", e))?;
        if n != entries.len() {
            return Err(Error::Snapshot {
                path: Default::default(),
                kind: SnapshotError::StateRejected(format!(
                    "KVM_SET_MSRS set {n} of {} MSRs (first refused: {:#x})",
                    entries.len(),
                    entries[n].index
                )),
            });
        }
    }
    fd.set_vcpu_events(&s.vcpu_events)
        .map_err(|e| rejected("KVM_SET_VCPU_EVENTS", e))?;
    // Tells a paravirtual guest it was stopped, so its watchdogs do not fire; optional.
    if let Err(e) = fd.kvmclock_ctrl() {
        tracing::debug!("KVM_KVMCLOCK_CTRL: {e}");
    }
    Ok(())
}

trait WithCtx {
    fn with_ctx<E: std::fmt::Debug>(self, e: E) -> Self;
}
impl WithCtx for Error {
    fn with_ctx<E: std::fmt::Debug>(self, e: E) -> Self {
        match self {
            Error::Snapshot {
                path,
                kind: SnapshotError::StateRejected(m),
            } => Error::Snapshot {
                path,
                kind: SnapshotError::StateRejected(format!("{m} ({e:?})")),
            },
            other => other,
        }
    }
}

/// Something a vCPU reports to the VM's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuEvent {
    /// The guest wrote its exit code to [`ports::DONE`]; the vCPU parked itself.
    Done(u32),
    /// The guest wrote a value to [`ports::CHECKPOINT`]; the vCPU keeps running.
    Checkpoint(u32),
    /// The guest wrote to [`ports::PAUSE_POINT`]; the vCPU parked itself right after the `out`.
    PausePoint(u32),
    /// The guest asked for a reset/shutdown (triple fault, `KVM_EXIT_SHUTDOWN`).
    Shutdown,
    /// KVM reported an error or an exit the VMM cannot handle; the vCPU parked itself.
    Error(String),
}

/// What the owner asked the thread to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Want {
    Pause = 0,
    Run = 1,
    Exit = 2,
}

struct Ctl {
    parked: bool,
}

/// Shared between a vCPU's owner and its thread.
pub(crate) struct VcpuShared {
    pub id: usize,
    pub fd: Mutex<VcpuFd>,
    /// Address of `kvm_run.immediate_exit` of this vCPU (lives as long as `fd`).
    immediate_exit: usize,
    want: AtomicU8,
    ctl: Mutex<Ctl>,
    cv: Condvar,
}

/// The buses and the event channel a vCPU thread dispatches to.
#[derive(Clone)]
pub(crate) struct ExitContext {
    pub pio: Arc<RwLock<Bus>>,
    pub mmio: Arc<RwLock<Bus>>,
    pub events: Sender<(usize, VcpuEvent)>,
    /// Guest RAM, for requests that carry a guest physical address.
    pub mem: GuestMemory,
    /// The guest kernel's extended-state save/restore (PVM hosts only).
    pub pv_xstate: Option<PvXstate>,
}

/// Signal used to kick vCPU threads out of KVM_RUN.
pub(crate) fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN() + 1
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) kick handler. Idempotent; without SA_RESTART so KVM_RUN sees EINTR.
pub(crate) fn install_kick_handler() -> Result<()> {
    vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick).map_err(|e| Error::Sys {
        op: "sigaction(kick signal)",
        source: std::io::Error::from_raw_os_error(e.errno()),
    })
}

/// A vCPU and its thread. The thread starts parked.
pub(crate) struct Vcpu {
    pub shared: Arc<VcpuShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Vcpu {
    pub fn spawn(id: usize, mut fd: VcpuFd, ctx: ExitContext) -> Result<Vcpu> {
        let immediate_exit = &mut fd.get_kvm_run().immediate_exit as *mut u8 as usize;
        let shared = Arc::new(VcpuShared {
            id,
            fd: Mutex::new(fd),
            immediate_exit,
            want: AtomicU8::new(Want::Pause as u8),
            ctl: Mutex::new(Ctl { parked: false }),
            cv: Condvar::new(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || vcpu_loop(s, ctx))
            .map_err(|e| Error::Sys {
                op: "spawn vCPU thread",
                source: e,
            })?;
        let v = Vcpu {
            shared,
            thread: Some(thread),
        };
        v.wait_parked(Duration::from_secs(5))?;
        Ok(v)
    }

    fn set_want(&self, w: Want) {
        let _g = self.shared.ctl.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.want.store(w as u8, Ordering::SeqCst);
        self.shared.cv.notify_all();
    }

    fn kick(&self) {
        // SAFETY: immediate_exit points into the kvm_run mapping owned by the VcpuFd, which
        // lives as long as `shared`. A racy byte store is the documented protocol.
        unsafe { std::ptr::write_volatile(self.shared.immediate_exit as *mut u8, 1) };
        if let Some(t) = &self.thread {
            use std::os::unix::thread::JoinHandleExt;
            // SAFETY: the thread is alive until joined in Drop.
            unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
        }
    }

    /// Lets the vCPU run.
    pub fn resume(&self) {
        {
            let mut c = self.shared.ctl.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.want.store(Want::Run as u8, Ordering::SeqCst);
            c.parked = false;
        }
        self.shared.cv.notify_all();
    }

    /// Asks the vCPU to stop (does not wait).
    pub fn request_pause(&self) {
        self.set_want(Want::Pause);
        self.kick();
    }

    pub fn wait_parked(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut c = self.shared.ctl.lock().unwrap_or_else(|e| e.into_inner());
        while !c.parked {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(format!("vCPU {} to pause", self.shared.id)));
            }
            let (g, _) = self
                .shared
                .cv
                .wait_timeout(c, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner());
            c = g;
            if !c.parked && self.shared.want.load(Ordering::SeqCst) == Want::Pause as u8 {
                self.kick(); // in case the thread blocked in KVM_RUN (e.g. halted) again
            }
        }
        Ok(())
    }
}

impl Drop for Vcpu {
    fn drop(&mut self) {
        self.set_want(Want::Exit);
        self.kick();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn vcpu_loop(s: Arc<VcpuShared>, ctx: ExitContext) {
    loop {
        {
            let mut c = s.ctl.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match s.want.load(Ordering::SeqCst) {
                    x if x == Want::Exit as u8 => {
                        c.parked = true;
                        s.cv.notify_all();
                        return;
                    }
                    x if x == Want::Run as u8 => break,
                    _ => {
                        if !c.parked {
                            c.parked = true;
                            s.cv.notify_all();
                        }
                        c = s.cv.wait(c).unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
            c.parked = false;
        }
        let mut fd = s.fd.lock().unwrap_or_else(|e| e.into_inner());
        fd.set_kvm_immediate_exit(0);
        // Runs until a pause is requested (None) or an exit parks the vCPU (Some(event)).
        let park_event = loop {
            if s.want.load(Ordering::SeqCst) != Want::Run as u8 {
                break None;
            }
            let outcome = match fd.run() {
                Ok(VcpuExit::InternalError) => {
                    Outcome::Park(Some(VcpuEvent::Error(describe_internal_error(&mut fd))))
                }
                Ok(exit) => handle_exit(s.id, exit, &ctx),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    fd.set_kvm_immediate_exit(0);
                    Outcome::Continue
                }
                Err(e) => Outcome::Park(Some(VcpuEvent::Error(format!("KVM_RUN: {e}")))),
            };
            match outcome {
                Outcome::Continue => {}
                Outcome::Xstate(op) => {
                    if let Some(pv) = &ctx.pv_xstate {
                        if let Err(e) = pv.serve(&fd, &ctx.mem, op) {
                            tracing::debug!(vcpu = s.id, "guest extended-state request: {e}");
                        }
                    }
                }
                Outcome::Event(ev) => {
                    let _ = ctx.events.send((s.id, ev));
                }
                Outcome::Park(ev) => break Some(ev),
            }
        };
        complete_pending_io(&mut fd);
        drop(fd);
        if let Some(ev) = park_event {
            // Park before reporting, so the owner sees a paused vCPU when it reacts.
            {
                let mut c = s.ctl.lock().unwrap_or_else(|e| e.into_inner());
                if s.want.load(Ordering::SeqCst) == Want::Run as u8 {
                    s.want.store(Want::Pause as u8, Ordering::SeqCst);
                }
                c.parked = true;
                s.cv.notify_all();
            }
            if let Some(ev) = ev {
                let _ = ctx.events.send((s.id, ev));
            }
        }
    }
}

/// Lets KVM finish an instruction whose I/O the VMM just served (an `in` or MMIO read result,
/// or the RIP update of an `out` on VMX hosts) before the vCPU parks: KVM completes it on the
/// next KVM_RUN, and with `immediate_exit` set that KVM_RUN returns at once without running
/// guest code. Without this a snapshot taken now would lose the completion.
fn complete_pending_io(fd: &mut VcpuFd) {
    fd.set_kvm_immediate_exit(1);
    match fd.run() {
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
        Err(e) => tracing::debug!("completing pending I/O: {e}"),
        Ok(exit) => tracing::debug!("completing pending I/O returned an exit: {exit:?}"),
    }
}

/// What KVM says about an internal error (suberror 1 is an instruction it could not emulate),
/// with the guest's RIP: without them such an exit cannot be diagnosed.
fn describe_internal_error(fd: &mut VcpuFd) -> String {
    // SAFETY: the last exit was KVM_EXIT_INTERNAL_ERROR, so `internal` is the active member.
    let (sub, data) = unsafe {
        let i = &fd.get_kvm_run().__bindgen_anon_1.internal;
        let n = (i.ndata as usize).min(i.data.len());
        (i.suberror, i.data[..n].to_vec())
    };
    let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
    let data: Vec<String> = data.iter().map(|d| format!("{d:#x}")).collect();
    format!(
        "KVM internal error: suberror {sub}, data [{}], rip {rip:#x}",
        data.join(", ")
    )
}

enum Outcome {
    Continue,
    /// A guest kernel's extended-state request, served with the vCPU's fd.
    Xstate(PvOp),
    Event(VcpuEvent),
    Park(Option<VcpuEvent>),
}

fn le_u32(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}

fn handle_exit(id: usize, exit: VcpuExit<'_>, ctx: &ExitContext) -> Outcome {
    match exit {
        VcpuExit::IoOut(port, data) => match port {
            ports::DONE => Outcome::Park(Some(VcpuEvent::Done(le_u32(data)))),
            ports::CHECKPOINT => Outcome::Event(VcpuEvent::Checkpoint(le_u32(data))),
            ports::PAUSE_POINT => Outcome::Park(Some(VcpuEvent::PausePoint(le_u32(data)))),
            ports::PARK => Outcome::Park(None),
            p => match ctx.pv_xstate.and(PvXstate::op(p, le_u32(data))) {
                Some(op) => Outcome::Xstate(op),
                None => {
                    let bus = ctx.pio.read().unwrap_or_else(|e| e.into_inner());
                    if !bus.write(port as u64, data) {
                        tracing::trace!(vcpu = id, port, "write to unclaimed port");
                    }
                    Outcome::Continue
                }
            },
        },
        VcpuExit::IoIn(port, data) => {
            if let (xstate::SIZE_PORT, Some(pv)) = (port, &ctx.pv_xstate) {
                let size = pv.size().to_le_bytes();
                for (i, b) in data.iter_mut().enumerate() {
                    *b = size.get(i).copied().unwrap_or(0);
                }
                return Outcome::Continue;
            }
            let bus = ctx.pio.read().unwrap_or_else(|e| e.into_inner());
            if !bus.read(port as u64, data) {
                data.fill(0xff); // floating bus
            }
            Outcome::Continue
        }
        VcpuExit::MmioRead(addr, data) => {
            let bus = ctx.mmio.read().unwrap_or_else(|e| e.into_inner());
            if !bus.read(addr, data) {
                data.fill(0xff);
            }
            Outcome::Continue
        }
        VcpuExit::MmioWrite(addr, data) => {
            let bus = ctx.mmio.read().unwrap_or_else(|e| e.into_inner());
            if !bus.write(addr, data) {
                tracing::trace!(vcpu = id, addr, "write to unclaimed MMIO");
            }
            Outcome::Continue
        }
        VcpuExit::Hlt => Outcome::Continue,
        VcpuExit::Shutdown => Outcome::Park(Some(VcpuEvent::Shutdown)),
        VcpuExit::SystemEvent(t, _) => {
            if t == kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN
                || t == kvm_bindings::KVM_SYSTEM_EVENT_RESET
            {
                Outcome::Park(Some(VcpuEvent::Shutdown))
            } else {
                Outcome::Park(Some(VcpuEvent::Error(format!("system event {t}"))))
            }
        }
        VcpuExit::FailEntry(reason, cpu) => Outcome::Park(Some(VcpuEvent::Error(format!(
            "entry failed: reason {reason:#x} on cpu {cpu}"
        )))),
        other => Outcome::Park(Some(VcpuEvent::Error(format!("unhandled exit {other:?}")))),
    }
}
