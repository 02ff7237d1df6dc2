//! Guest processes keep their own vector registers. The project's guest kernel boots with
//! `deploy/guest-kernel/xstate-probe.c` as init: processes that share one vCPU fill the widest
//! registers the CPU lets user mode use (AVX-512 zmm0-31 and k0-7 on this project's hosts),
//! yield to each other and check them. On PVM hosts guest user mode uses the host's vector
//! state natively while the guest kernel cannot run XSAVE; unless the VMM saves that state for
//! it (cube-hypervisor's `vstate::xstate`), one process sees another's registers: that is how a
//! restored interpreter worker died (issue 24).
//!
//! Needs /dev/kvm, the guest kernel (`CUBE_GUEST_KERNEL`) and a C compiler with static glibc.

mod common;

use common::run;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::legacy::{
    Serial, I8042, I8042_PORT_BASE, I8042_PORT_LEN, SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN,
};
use cube_hypervisor::loader::KernelConfig;
use cube_hypervisor::{Shape, VcpuEvent, Vmm};
use cube_shim::template::PVM_CMDLINE;

const LEVELS: [&str; 3] = ["SSE (xmm0-15)", "AVX (ymm0-15)", "AVX-512 (zmm0-31, k0-7)"];

/// The console, kept in memory.
#[derive(Clone, Default)]
struct Console(Arc<Mutex<Vec<u8>>>);
impl Write for Console {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
impl Console {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// An initramfs whose /init is the probe, compiled here.
fn probe_initramfs(work: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/guest-kernel/xstate-probe.c");
    let root = work.join("root");
    std::fs::create_dir_all(root.join("dev")).unwrap();
    run(Command::new("cc")
        .args(["-static", "-O2", "-o"])
        .arg(root.join("init"))
        .arg(&src));
    let cpio = work.join("probe.cpio");
    run(Command::new("sh")
        .arg("-c")
        .arg("find . | cpio -o -H newc --quiet > \"$0\"")
        .arg(&cpio)
        .current_dir(&root));
    cpio
}

/// The widest vector state this process may use, by the probe's own test.
fn host_level() -> usize {
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        2
    } else if std::arch::is_x86_feature_detected!("avx") {
        1
    } else {
        0
    }
}

#[test]
fn guest_processes_keep_their_own_vector_registers() {
    cube_testkit::require_kvm!("linux_guest_xstate");
    let Some(kernel) = common::guest_kernel() else {
        return;
    };
    let work = tempfile::Builder::new()
        .prefix("cube-xstate-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let initramfs = probe_initramfs(work.path());

    let vmm = Vmm::new().unwrap();
    let mut vm = vmm.create_vm(Shape::new(1, 256)).unwrap();
    let irq = IrqLine::new(SERIAL_GSI).unwrap();
    vm.register_irq(&irq).unwrap();
    let console = Console::default();
    let serial = Serial::new(irq, Box::new(console.clone()));
    vm.add_pio_device(
        SERIAL_PORT_BASE,
        SERIAL_PORT_LEN,
        Arc::new(Mutex::new(serial)),
    )
    .unwrap();
    let i8042 = I8042::new().unwrap();
    vm.add_pio_device(I8042_PORT_BASE, I8042_PORT_LEN, Arc::new(Mutex::new(i8042)))
        .unwrap();
    let mut cmdline = "console=ttyS0 reboot=k panic=1 pci=off nomodule rdinit=/init".to_string();
    if vmm.is_pvm() {
        cmdline = format!("{cmdline} {PVM_CMDLINE}");
    }
    vm.load_kernel(&KernelConfig {
        kernel,
        cmdline,
        initramfs: Some(initramfs),
    })
    .unwrap();
    vm.resume().unwrap();

    // Boot (tens of seconds where guest kernel mode is emulated) and the probe's switches.
    let t0 = Instant::now();
    let verdict = loop {
        let text = console.text();
        if let Some(line) = text.lines().find(|l| {
            l.starts_with("xstate-probe: ") && (l.contains(" ok (") || l.contains(" CORRUPT"))
        }) {
            // Let the other processes finish their lines too.
            std::thread::sleep(Duration::from_millis(500));
            break line.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(400),
            "no result from the probe:\n{text}"
        );
        match vm.next_event(Duration::from_millis(200)).unwrap() {
            Some((id, VcpuEvent::Error(e))) => panic!("vCPU {id}: {e}\n{text}"),
            Some((_, VcpuEvent::Shutdown)) => panic!("guest shut down:\n{text}"),
            _ => {}
        }
    };
    vm.pause().unwrap();
    let text = console.text();
    eprintln!("{verdict} ({:?} after start)", t0.elapsed());
    assert!(
        !text.contains("CORRUPT") && verdict.contains(" ok ("),
        "a guest process saw another's registers:\n{text}"
    );
    // The probe must have exercised the widest state there is, or it proved nothing about it.
    assert!(
        verdict.contains(LEVELS[host_level()]),
        "{verdict} (host: {}):\n{text}",
        LEVELS[host_level()]
    );
    if vmm.is_pvm() {
        assert!(
            text.contains("cube_pvm: the VMM saves the extended state"),
            "the guest kernel did not take the VMM's extended-state save:\n{text}"
        );
    }
}
