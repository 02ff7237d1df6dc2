//! The host side ([`Vmm`]: one `/dev/kvm` handle plus what it reports about the host) and a
//! VM ([`Vm`]: KVM VM, guest RAM, vCPU threads, PIO/MMIO buses).

use std::path::Path;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_regs, kvm_sregs, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm, VmFd};
use sha2::{Digest, Sha256};
use vm_memory::{Bytes, GuestAddress};

use crate::arch;
use crate::devices::bus::{Bus, BusDevice};
use crate::devices::irq::IrqLine;
use crate::error::{kvm, Error, Result};
use crate::vstate::memory::{GuestMemory, GuestRam};
use crate::vstate::vcpu::{self, ExitContext, Vcpu, VcpuEvent, PVM_MSRS};
use crate::vstate::xstate::{self, PvXstate, XsaveLayout};

/// RFLAGS.IF: interrupts enabled.
const RFLAGS_IF: u64 = 1 << 9;

/// Shape of a VM: what a snapshot and a shell must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    pub vcpus: u8,
    pub mem_mib: u32,
}

impl Shape {
    pub fn new(vcpus: u8, mem_mib: u32) -> Self {
        Shape { vcpus, mem_mib }
    }

    pub fn mem_bytes(&self) -> u64 {
        (self.mem_mib as u64) << 20
    }

    fn validate(&self, max_vcpus: usize) -> Result<()> {
        if self.vcpus == 0 || self.vcpus as usize > max_vcpus.min(254) {
            return Err(Error::InvalidConfig(format!(
                "vCPU count {} is outside 1..={}",
                self.vcpus,
                max_vcpus.min(254)
            )));
        }
        if self.mem_mib < 4 || !self.mem_mib.is_multiple_of(2) {
            return Err(Error::InvalidConfig(format!(
                "memory {} MiB must be an even number of MiB, at least 4",
                self.mem_mib
            )));
        }
        Ok(())
    }
}

pub(crate) struct VmmInner {
    pub kvm: Kvm,
    pub msrs: Vec<u32>,
    pub pvm: bool,
    pub cpu_model_hash: String,
    pub cpuid: CpuId,
    pub xsave: XsaveLayout,
}

/// The host's KVM, opened once per process and shared by its VMs (cheap to clone).
#[derive(Clone)]
pub struct Vmm {
    pub(crate) inner: Arc<VmmInner>,
}

/// True when the host's KVM vendor module is PVM (pagetable-based virtual machine).
fn host_is_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

impl Vmm {
    /// Opens `/dev/kvm` and checks the capabilities the VMM relies on.
    pub fn new() -> Result<Vmm> {
        let kvm_sys =
            Kvm::new().map_err(|e| Error::KvmUnavailable(format!("open /dev/kvm: {e}")))?;
        for cap in [
            Cap::Irqchip,
            Cap::Pit2,
            Cap::PitState2,
            Cap::Irqfd,
            Cap::UserMemory,
            Cap::SetTssAddr,
            Cap::AdjustClock,
            Cap::Debugregs,
            Cap::MpState,
            Cap::VcpuEvents,
            // Not Cap::Xcrs: KVM offers it only where the CPU has XSAVE; without it guests
            // use FXSAVE and a vCPU's saved XCR list is empty (vstate::vcpu).
            Cap::Xsave,
            Cap::ExtCpuid,
            Cap::ImmediateExit,
        ] {
            if !kvm_sys.check_extension(cap) {
                return Err(Error::KvmUnavailable(format!("missing capability {cap:?}")));
            }
        }
        let pvm = host_is_pvm();
        let mut msrs: Vec<u32> = kvm_sys
            .get_msr_index_list()
            .map_err(kvm("KVM_GET_MSR_INDEX_LIST"))?
            .as_slice()
            .to_vec();
        if pvm {
            for m in PVM_MSRS {
                if !msrs.contains(&m) {
                    msrs.push(m);
                }
            }
        }
        let mut cpuid = kvm_sys
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("KVM_GET_SUPPORTED_CPUID"))?;
        if pvm {
            crate::arch::restrict_pv_features(&mut cpuid);
        }
        // Guest user mode on PVM runs natively, with the host's XCR0 (less what the kernel
        // withholds from this process: AMX); elsewhere the guest gets only what the CPUID
        // table's leaf 0xD offers.
        let xsave = XsaveLayout::of(&cpuid);
        let usable = if pvm {
            xstate::user_usable_xfeatures()
        } else {
            xsave.features
        };
        xstate::check(xsave, usable).map_err(Error::KvmUnavailable)?;
        let cpu_model_hash = cpu_model_hash(&HostCpu::read(), &cpuid, &msrs, pvm);
        vcpu::install_kick_handler()?;
        Ok(Vmm {
            inner: Arc::new(VmmInner {
                kvm: kvm_sys,
                msrs,
                pvm,
                cpu_model_hash,
                cpuid,
                xsave,
            }),
        })
    }

    /// Whether the host runs PVM (PVM MSRs are then saved too).
    pub fn is_pvm(&self) -> bool {
        self.inner.pvm
    }

    /// Digest of what a snapshot's CPU state depends on: vendor/model, the CPUID KVM offers,
    /// the MSR list, the KVM flavour.
    pub fn cpu_model_hash(&self) -> &str {
        &self.inner.cpu_model_hash
    }

    /// MSR indices saved in snapshots.
    pub fn msr_list(&self) -> &[u32] {
        &self.inner.msrs
    }

    /// Creates a VM with fresh anonymous memory, ready for [`Vm::load_test_guest`] or
    /// [`Vm::load_kernel`].
    pub fn create_vm(&self, shape: Shape) -> Result<Vm> {
        let vm = Vm::create(self, shape)?;
        arch::write_system_tables(vm.memory())?;
        Ok(vm)
    }
}

/// What this process sees of its CPU: `/proc/cpuinfo`'s first CPU, CPUID's feature words, XCR0.
/// On PVM that is also what guest user mode sees, and what guest programs chose their code
/// paths by (glibc's string functions, numpy's kernels).
struct HostCpu {
    cpuinfo: String,
    features: Vec<u32>,
    xcr0: u64,
}

impl HostCpu {
    fn read() -> HostCpu {
        HostCpu {
            cpuinfo: std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default(),
            features: native_cpu_features(),
            xcr0: xstate::host_xcr0(),
        }
    }
}

fn cpu_model_hash(host: &HostCpu, cpuid: &CpuId, msrs: &[u32], pvm: bool) -> String {
    let mut h = Sha256::new();
    for line in host.cpuinfo.lines() {
        if line.starts_with("vendor_id")
            || line.starts_with("cpu family")
            || line.starts_with("model")
            || line.starts_with("stepping")
        {
            h.update(line.as_bytes());
            h.update(b"\n");
        }
        if line.is_empty() {
            break; // first CPU only
        }
    }
    for e in cpuid.as_slice() {
        // Per-CPU fields (APIC ids) depend on which host CPU answered; leave them out.
        let (mut ebx, mut edx) = (e.ebx, e.edx);
        match e.function {
            1 => ebx &= 0x0000_ffff,
            0xb | 0x1f => edx = 0,
            _ => {}
        }
        for v in [e.function, e.index, e.flags, e.eax, ebx, e.ecx, edx] {
            h.update(v.to_le_bytes());
        }
    }
    for m in msrs {
        h.update(m.to_le_bytes());
    }
    h.update([pvm as u8]);
    // A host with other features, though the same model, must not restore the snapshot.
    for v in &host.features {
        h.update(v.to_le_bytes());
    }
    h.update(host.xcr0.to_le_bytes());
    let d = h.finalize();
    d.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Feature words of CPUID as this process sees it (per-CPU fields left out).
fn native_cpu_features() -> Vec<u32> {
    use std::arch::x86_64::{__cpuid, __cpuid_count, CpuidResult};
    let zero = CpuidResult {
        eax: 0,
        ebx: 0,
        ecx: 0,
        edx: 0,
    };
    let max = __cpuid(0).eax;
    let max_ext = __cpuid(0x8000_0000).eax;
    let l1 = __cpuid(1);
    let mut v = vec![l1.eax, l1.ecx, l1.edx];
    for (leaf, sub) in [(7, 0), (7, 1), (0xd, 0), (0xd, 1)] {
        let r = if leaf <= max {
            __cpuid_count(leaf, sub)
        } else {
            zero
        };
        v.extend([r.eax, r.ebx, r.ecx, r.edx]);
    }
    let ext = |leaf| if leaf <= max_ext { __cpuid(leaf) } else { zero };
    let (e1, e8) = (ext(0x8000_0001), ext(0x8000_0008));
    // 0x8000_0008: address sizes and feature bits, not its core counts (ECX).
    v.extend([e1.ecx, e1.edx, e8.eax, e8.ebx]);
    v
}

/// How a run of the guest ended (see [`Vm::run_until`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// The guest reported done with this exit code (0 = success).
    Done(u32),
    /// The guest stopped at a pause point carrying this value; all vCPUs are paused.
    PausePoint(u32),
    /// The guest shut down (triple fault or reset request).
    Shutdown,
}

/// Result of [`Vm::run_until`]: how it ended and the checkpoint values seen on the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    pub outcome: RunOutcome,
    pub checkpoints: Vec<u32>,
}

/// Where a VM's memory came from, for pause-to-disk (which writes only what differs).
#[derive(Clone, Debug)]
pub(crate) struct MemoryBase {
    pub path: std::path::PathBuf,
    pub size: u64,
    pub crc32: u32,
}

/// A VM: KVM VM + guest RAM + vCPU threads (created parked) + buses.
///
/// All vCPUs are paused unless [`Vm::resume`] (or [`Vm::run_until`]) runs them; state
/// accessors ([`Vm::regs`], snapshots) need a paused VM.
pub struct Vm {
    pub(crate) vmm: Vmm,
    pub(crate) shape: Shape,
    // Field order matters for drop: vCPU threads stop before the VM fd and RAM go away.
    pub(crate) vcpus: Vec<Vcpu>,
    pub(crate) vm_fd: Arc<VmFd>,
    pub(crate) ram: GuestRam,
    pio: Arc<RwLock<Bus>>,
    mmio: Arc<RwLock<Bus>>,
    events: Receiver<(usize, VcpuEvent)>,
    running: bool,
    pub(crate) base: Option<MemoryBase>,
    pub(crate) kernel_digest: Option<String>,
    irqs: Vec<u32>,
}

impl Vm {
    /// VM + memslot on an anonymous placeholder + vCPUs (parked threads). This is also a shell.
    pub(crate) fn create(vmm: &Vmm, shape: Shape) -> Result<Vm> {
        shape.validate(vmm.inner.kvm.get_max_vcpus())?;
        let ram = GuestRam::anonymous(shape.mem_bytes())?;
        let vm_fd = crate::vstate::vm::create_vm(&vmm.inner.kvm)?;
        let region = kvm_bindings::kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: ram.size(),
            userspace_addr: ram.host_addr(),
        };
        let (tx, rx) = channel();
        let pio = Arc::new(RwLock::new(Bus::new()));
        let mmio = Arc::new(RwLock::new(Bus::new()));
        let ctx = ExitContext {
            pio: pio.clone(),
            mmio: mmio.clone(),
            events: tx,
            mem: ram.memory().clone(),
            pv_xstate: if vmm.inner.pvm {
                PvXstate::new(vmm.inner.xsave)
            } else {
                None
            },
        };
        // Memslot registration is the slow part of VM creation (several ms, growing with size,
        // mostly SRCU synchronization in KVM): run it in parallel with vCPU creation, which
        // takes different KVM locks.
        let (slot, vcpus) = std::thread::scope(|sc| {
            let slot = sc.spawn(|| {
                // SAFETY: the region is our own mapping, alive as long as the VM (drop order).
                unsafe { vm_fd.set_user_memory_region(region) }
                    .map_err(kvm("KVM_SET_USER_MEMORY_REGION"))
            });
            let vcpus = (0..shape.vcpus as usize)
                .map(|id| -> Result<Vcpu> {
                    let fd = vm_fd
                        .create_vcpu(id as u64)
                        .map_err(kvm("KVM_CREATE_VCPU"))?;
                    let mut cpuid = vmm.inner.cpuid.clone();
                    arch::patch_cpuid(&mut cpuid, id, shape.vcpus as usize);
                    fd.set_cpuid2(&cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
                    let mut lapic = fd.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
                    arch::set_lint(&mut lapic);
                    fd.set_lapic(&lapic).map_err(kvm("KVM_SET_LAPIC"))?;
                    Vcpu::spawn(id, fd, ctx.clone())
                })
                .collect::<Result<Vec<Vcpu>>>();
            let slot = slot
                .join()
                .unwrap_or_else(|_| Err(Error::WrongState("memslot thread panicked".into())));
            (slot, vcpus)
        });
        let vcpus = vcpus?;
        slot?;
        Ok(Vm {
            vmm: vmm.clone(),
            shape,
            vcpus,
            vm_fd: Arc::new(vm_fd),
            ram,
            pio,
            mmio,
            events: rx,
            running: false,
            base: None,
            kernel_digest: None,
            irqs: Vec::new(),
        })
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Guest RAM, as devices see it. Stays valid across a restore into this VM's shell.
    pub fn memory(&self) -> &GuestMemory {
        self.ram.memory()
    }

    /// Host virtual address range of guest RAM (e.g. to attribute PSS to guest pages).
    pub fn host_ram_range(&self) -> std::ops::Range<u64> {
        self.ram.host_addr()..self.ram.host_addr() + self.ram.size()
    }

    pub fn vm_fd(&self) -> &VmFd {
        &self.vm_fd
    }

    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Loads a flat CPL3 test guest at [`crate::test_guests::LOAD_ADDR`] and points every vCPU
    /// at it (see the guest ABI in [`crate::test_guests`]).
    pub fn load_test_guest(&mut self, image: &[u8]) -> Result<()> {
        self.require_paused("load a guest")?;
        let load = crate::test_guests::LOAD_ADDR;
        if image.is_empty() || load + image.len() as u64 > self.ram.size() {
            return Err(Error::Load(format!(
                "image of {} bytes at {load:#x} does not fit in {} MiB",
                image.len(),
                self.shape.mem_mib
            )));
        }
        self.memory()
            .write_slice(image, GuestAddress(load))
            .map_err(|e| Error::Load(e.to_string()))?;
        let n = self.vcpus.len();
        for (i, v) in self.vcpus.iter().enumerate() {
            let fd = v.shared.fd.lock().unwrap_or_else(|e| e.into_inner());
            let mut sregs = fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
            let mut regs = kvm_regs::default();
            arch::setup_user_entry(&mut sregs, &mut regs, load, i, n);
            // What a guest kernel would do: enable every XSAVE component KVM offers, so test
            // guests can use (and snapshots must keep) the widest vector state. On PVM guest
            // user mode has the host's XCR0 regardless.
            let xcr0 = self.vmm.inner.xsave.features;
            let mut with_xsave = sregs;
            with_xsave.cr4 |= arch::CR4_OSXSAVE;
            if xcr0 != xstate::XFEATURE_FPSSE && fd.set_sregs(&with_xsave).is_ok() {
                let mut xcrs = kvm_bindings::kvm_xcrs {
                    nr_xcrs: 1,
                    ..Default::default()
                };
                xcrs.xcrs[0].value = xcr0;
                fd.set_xcrs(&xcrs).map_err(kvm("KVM_SET_XCRS"))?;
            } else {
                fd.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;
            }
            fd.set_regs(&regs).map_err(kvm("KVM_SET_REGS"))?;
            // Secondary vCPUs start runnable too (no INIT/SIPI dance for test guests).
            fd.set_mp_state(kvm_bindings::kvm_mp_state {
                mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
            })
            .map_err(kvm("KVM_SET_MP_STATE"))?;
        }
        Ok(())
    }

    /// Loads a Linux kernel (PVH ELF first, bzImage second); see [`crate::loader`].
    pub fn load_kernel(
        &mut self,
        cfg: &crate::loader::KernelConfig,
    ) -> Result<crate::loader::KernelEntry> {
        self.require_paused("load a kernel")?;
        let entry = crate::loader::load_kernel(self.memory(), self.shape, cfg)?;
        let fd = self.vcpus[0]
            .shared
            .fd
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut sregs = fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
        let mut regs = kvm_regs::default();
        match entry.mode {
            crate::loader::EntryMode::Pvh => {
                arch::setup_pvh_entry(&mut sregs, &mut regs, entry.entry)
            }
            crate::loader::EntryMode::Linux64 => {
                arch::setup_linux64_entry(&mut sregs, &mut regs, entry.entry)
            }
        }
        fd.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;
        fd.set_regs(&regs).map_err(kvm("KVM_SET_REGS"))?;
        drop(fd);
        self.kernel_digest = Some(entry.digest.clone());
        Ok(entry)
    }

    /// Places a device on the port-I/O bus.
    pub fn add_pio_device(
        &self,
        base: u64,
        len: u64,
        dev: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<()> {
        if base.checked_add(len).is_none_or(|end| end > 0x1_0000) {
            return Err(Error::Bus(format!(
                "port range {base:#x}+{len:#x} exceeds 16 bits"
            )));
        }
        self.pio
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(base, len, dev)
            .map_err(|e| Error::Bus(format!("{e:?}")))
    }

    /// Places a device on the MMIO bus (virtio-mmio windows live from 0xc000_0000).
    pub fn add_mmio_device(
        &self,
        base: u64,
        len: u64,
        dev: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<()> {
        if base < self.ram.size() {
            return Err(Error::Bus(format!(
                "MMIO window {base:#x} overlaps guest RAM"
            )));
        }
        self.mmio
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(base, len, dev)
            .map_err(|e| Error::Bus(format!("{e:?}")))
    }

    /// Connects a device interrupt line to its GSI via a KVM irqfd.
    pub fn register_irq(&mut self, line: &IrqLine) -> Result<()> {
        self.vm_fd
            .register_irqfd(line.eventfd(), line.gsi())
            .map_err(kvm("KVM_IRQFD"))?;
        self.irqs.push(line.gsi());
        Ok(())
    }

    /// Raises or lowers an interrupt line directly (tests, legacy IRQs).
    pub fn set_irq_line(&self, gsi: u32, level: bool) -> Result<()> {
        self.vm_fd
            .set_irq_line(gsi, level)
            .map_err(kvm("KVM_IRQ_LINE"))
    }

    /// Runs all vCPUs.
    pub fn resume(&mut self) -> Result<()> {
        for v in &self.vcpus {
            v.resume();
        }
        self.running = true;
        Ok(())
    }

    /// Stops all vCPUs (kick + wait until each is parked outside KVM_RUN).
    pub fn pause(&mut self) -> Result<()> {
        for v in &self.vcpus {
            v.request_pause();
        }
        for v in &self.vcpus {
            v.wait_parked(Duration::from_secs(10))?;
        }
        self.running = false;
        Ok(())
    }

    /// Next vCPU event, if one arrives within `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Result<Option<(usize, VcpuEvent)>> {
        match self.events.recv_timeout(timeout) {
            Ok(ev) => Ok(Some(ev)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                Err(Error::WrongState("vCPU threads are gone".into()))
            }
        }
    }

    /// Resumes the guest and waits until it reports done, reaches a pause point or shuts down,
    /// collecting checkpoints on the way. The VM is paused when this returns (also on error).
    pub fn run_until(&mut self, timeout: Duration) -> Result<RunReport> {
        self.resume()?;
        let deadline = Instant::now() + timeout;
        let mut checkpoints = Vec::new();
        let result = loop {
            let now = Instant::now();
            if now >= deadline {
                break Err(Error::Timeout(format!(
                    "guest to finish after {timeout:?} (checkpoints so far: {checkpoints:x?})"
                )));
            }
            match self.next_event(deadline - now)? {
                None => continue,
                Some((_, VcpuEvent::Checkpoint(v))) => checkpoints.push(v),
                Some((_, VcpuEvent::Done(c))) => break Ok(RunOutcome::Done(c)),
                Some((_, VcpuEvent::PausePoint(v))) => break Ok(RunOutcome::PausePoint(v)),
                Some((_, VcpuEvent::Shutdown)) => break Ok(RunOutcome::Shutdown),
                Some((id, VcpuEvent::Error(msg))) => break Err(Error::Vcpu { vcpu: id, msg }),
            }
        };
        self.pause()?;
        result.map(|outcome| RunReport {
            outcome,
            checkpoints,
        })
    }

    fn require_paused(&self, what: &str) -> Result<()> {
        if self.running {
            return Err(Error::WrongState(format!("pause the VM to {what}")));
        }
        Ok(())
    }

    fn vcpu(&self, id: usize) -> Result<&Vcpu> {
        self.vcpus
            .get(id)
            .ok_or_else(|| Error::InvalidConfig(format!("no vCPU {id}")))
    }

    /// Whether the guest has stopped for good: every vCPU halted with interrupts disabled.
    /// That is how Linux ends `poweroff` on a machine without ACPI (`machine_halt`), and only
    /// an NMI, which this VMM never sends, could wake such a vCPU. The VM is paused to look and
    /// resumed unless it has stopped.
    pub fn halted_for_good(&mut self) -> Result<bool> {
        self.pause()?;
        let mut stopped = true;
        for v in &self.vcpus {
            let fd = v.shared.fd.lock().unwrap_or_else(|e| e.into_inner());
            let mp = fd.get_mp_state().map_err(kvm("KVM_GET_MP_STATE"))?;
            let regs = fd.get_regs().map_err(kvm("KVM_GET_REGS"))?;
            if mp.mp_state != kvm_bindings::KVM_MP_STATE_HALTED || regs.rflags & RFLAGS_IF != 0 {
                stopped = false;
                break;
            }
        }
        if !stopped {
            self.resume()?;
        }
        Ok(stopped)
    }

    /// General registers of a paused vCPU.
    pub fn regs(&self, id: usize) -> Result<kvm_regs> {
        self.require_paused("read registers")?;
        let fd = self
            .vcpu(id)?
            .shared
            .fd
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        fd.get_regs().map_err(kvm("KVM_GET_REGS"))
    }

    pub fn set_regs(&self, id: usize, regs: &kvm_regs) -> Result<()> {
        self.require_paused("write registers")?;
        let fd = self
            .vcpu(id)?
            .shared
            .fd
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        fd.set_regs(regs).map_err(kvm("KVM_SET_REGS"))
    }

    pub fn sregs(&self, id: usize) -> Result<kvm_sregs> {
        self.require_paused("read registers")?;
        let fd = self
            .vcpu(id)?
            .shared
            .fd
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))
    }

    /// Reads a little-endian u64 of guest memory.
    pub fn read_u64(&self, gpa: u64) -> Result<u64> {
        self.memory()
            .read_obj(GuestAddress(gpa))
            .map_err(|e| Error::Memory(e.to_string()))
    }

    pub fn write_u64(&self, gpa: u64, v: u64) -> Result<()> {
        self.memory()
            .write_obj(v, GuestAddress(gpa))
            .map_err(|e| Error::Memory(e.to_string()))
    }

    pub fn read_bytes(&self, gpa: u64, buf: &mut [u8]) -> Result<()> {
        self.memory()
            .read_slice(buf, GuestAddress(gpa))
            .map_err(|e| Error::Memory(e.to_string()))
    }

    pub fn write_bytes(&self, gpa: u64, buf: &[u8]) -> Result<()> {
        self.memory()
            .write_slice(buf, GuestAddress(gpa))
            .map_err(|e| Error::Memory(e.to_string()))
    }

    /// Saves every vCPU's and the VM's KVM state (the VM must be paused).
    pub fn save_state(&self) -> Result<(Vec<vcpu::VcpuState>, crate::vstate::vm::VmState)> {
        self.require_paused("save state")?;
        let mut states = Vec::with_capacity(self.vcpus.len());
        for v in &self.vcpus {
            let fd = v.shared.fd.lock().unwrap_or_else(|e| e.into_inner());
            states.push(vcpu::save_state(&fd, &self.vmm.inner.msrs)?);
        }
        Ok((states, crate::vstate::vm::save_state(&self.vm_fd)?))
    }

    pub(crate) fn restore_kvm_state(
        &self,
        vcpus: &[vcpu::VcpuState],
        vm: &crate::vstate::vm::VmState,
    ) -> Result<()> {
        for (v, s) in self.vcpus.iter().zip(vcpus) {
            let fd = v.shared.fd.lock().unwrap_or_else(|e| e.into_inner());
            vcpu::restore_state(&fd, s)?;
        }
        crate::vstate::vm::restore_state(&self.vm_fd, vm)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // Stop and join the vCPU threads before the memslot's mapping is unmapped.
        self.vcpus.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(model: &str, leaf7_ebx: u32, xcr0: u64) -> HostCpu {
        HostCpu {
            cpuinfo: format!(
                "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n\nmodel\t\t: 99\n"
            ),
            features: vec![0x00a1_0f11, 0xfffa_3203, 0x178b_fbff, leaf7_ebx],
            xcr0,
        }
    }

    #[test]
    fn the_cpu_hash_ignores_intel_and_amd_per_cpu_ids_but_not_the_topology() {
        let h = host("17", 0xf1bf_07ab, 0xe7);
        let hash = |entries: &[kvm_bindings::kvm_cpuid_entry2]| {
            cpu_model_hash(&h, &CpuId::from_entries(entries).unwrap(), &[0x10], false)
        };
        let e = |function, index, eax, ebx, edx| kvm_bindings::kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            edx,
            ..Default::default()
        };
        // Which host CPU answered shows in leaf 1's APIC id and Intel's x2APIC ids (0xB, 0x1F).
        let base = hash(&[e(1, 0, 0x906ea, 0x0100_0800, 0), e(0x1f, 1, 4, 8, 3)]);
        assert_eq!(
            base,
            hash(&[e(1, 0, 0x906ea, 0x0700_0800, 0), e(0x1f, 1, 4, 8, 6)])
        );
        // The topology itself (shift widths, counts) and the model do count.
        assert_ne!(
            base,
            hash(&[e(1, 0, 0x906ea, 0x0100_0800, 0), e(0x1f, 1, 5, 8, 3)])
        );
        assert_ne!(
            base,
            hash(&[e(1, 0, 0x906eb, 0x0100_0800, 0), e(0x1f, 1, 4, 8, 3)])
        );
    }

    #[test]
    fn the_cpu_hash_tells_apart_hosts_whose_features_differ() {
        let cpuid = CpuId::new(1).unwrap();
        let hash = |h: &HostCpu, pvm| cpu_model_hash(h, &cpuid, &[0x10], pvm);
        let base = hash(&host("17", 0xf1bf_07ab, 0xe7), true);
        assert_eq!(base, hash(&host("17", 0xf1bf_07ab, 0xe7), true));
        // Only the first CPU's lines count.
        assert_eq!(base.len(), 32);
        // Same model, AVX-512F hidden from this host's CPUID (as a cloud VM may do).
        assert_ne!(
            base,
            hash(&host("17", 0xf1bf_07ab & !(1 << 16), 0xe7), true)
        );
        // Same CPUID, AVX-512 state not enabled by this host's kernel.
        assert_ne!(base, hash(&host("17", 0xf1bf_07ab, 0x7), true));
        // Another model, another KVM flavour.
        assert_ne!(base, hash(&host("2", 0xf1bf_07ab, 0xe7), true));
        assert_ne!(base, hash(&host("17", 0xf1bf_07ab, 0xe7), false));
    }
}
