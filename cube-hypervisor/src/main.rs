//! `cube-hypervisor`: debug front end of the library — run test guests, boot a kernel,
//! snapshot, restore (full or pause-to-disk images), inspect snapshots.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::legacy::{
    Serial, I8042, I8042_PORT_BASE, I8042_PORT_LEN, SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN,
};
use cube_hypervisor::loader::KernelConfig;
use cube_hypervisor::{restore, test_guests, RunOutcome, Shape, Snapshot, VcpuEvent, Vm, Vmm};

/// How often `boot` checks whether a quiet guest has halted for good.
const HALT_LOOK_EVERY: Duration = Duration::from_secs(1);

#[derive(Parser)]
#[command(
    name = "cube-hypervisor",
    about = "Cube microVM monitor (debug front end)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a Linux kernel (PVH vmlinux or bzImage) with a serial console on stdout.
    Boot {
        #[arg(long)]
        kernel: PathBuf,
        #[arg(
            long,
            default_value = "console=ttyS0 reboot=k panic=1 pci=off nomodule"
        )]
        cmdline: String,
        #[arg(long)]
        initramfs: Option<PathBuf>,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        #[arg(long, default_value_t = 256)]
        mem_mib: u32,
        /// Stop after this many seconds (0 = until the guest shuts down).
        #[arg(long, default_value_t = 10)]
        secs: u64,
        /// Snapshot the VM into this directory when stopping.
        #[arg(long)]
        snapshot: Option<PathBuf>,
    },
    /// Run a built-in CPL3 test guest until it is done or reaches a pause point.
    RunGuest {
        /// Guest name: pattern, spin, io, timer, crash, bench, serial (see `list-guests`).
        #[arg(long)]
        guest: String,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        #[arg(long, default_value_t = 32)]
        mem_mib: u32,
        /// u64 guest parameters, in order (params+0, +8, ...).
        #[arg(long, value_delimiter = ',')]
        params: Vec<u64>,
        /// Snapshot into this directory when the guest stops (pause point or done).
        #[arg(long)]
        snapshot: Option<PathBuf>,
        #[arg(long, default_value_t = 30)]
        timeout_secs: u64,
    },
    /// Restore a snapshot or pause-to-disk image, report vCPU state, optionally run it.
    Restore {
        #[arg(long)]
        dir: PathBuf,
        /// Run for this many milliseconds after restoring, then pause and report again.
        #[arg(long, default_value_t = 0)]
        run_ms: u64,
        /// Run until the guest signals done / a pause point instead (test guests).
        #[arg(long)]
        until_done: bool,
        /// Report a CRC32 of guest memory ADDR:LEN (decimal) as `read_crc32`.
        #[arg(long)]
        read: Option<String>,
        /// Afterwards, pause to disk into this directory.
        #[arg(long)]
        pause_to_disk: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print a snapshot's manifest; optionally verify the memory checksum.
    Inspect {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        verify_memory: bool,
    },
    /// List the built-in test guests.
    ListGuests,
}

fn guest_image(name: &str) -> Result<&'static [u8]> {
    Ok(match name {
        "pattern" => test_guests::PATTERN,
        "spin" => test_guests::SPIN,
        "io" => test_guests::IO,
        "timer" => test_guests::TIMER,
        "crash" => test_guests::CRASH,
        "bench" => test_guests::BENCH,
        "serial" => test_guests::SERIAL,
        other => bail!("unknown test guest {other:?} (try list-guests)"),
    })
}

fn vcpu_report(vm: &Vm) -> Result<Vec<serde_json::Value>> {
    (0..vm.shape().vcpus as usize)
        .map(|i| {
            let r = vm.regs(i)?;
            Ok(serde_json::json!({
                "rip": r.rip, "rsp": r.rsp, "rax": r.rax, "rbx": r.rbx, "rcx": r.rcx,
                "r12": r.r12, "r13": r.r13, "r14": r.r14, "r15": r.r15, "rflags": r.rflags,
            }))
        })
        .collect()
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::ListGuests => {
            for g in ["pattern", "spin", "io", "timer", "crash", "bench", "serial"] {
                println!("{g}");
            }
        }
        Cmd::Inspect { dir, verify_memory } => {
            let snap = Snapshot::open(&dir).with_context(|| format!("open {}", dir.display()))?;
            println!("{}", serde_json::to_string_pretty(snap.manifest())?);
            println!(
                "devices: {:?}",
                snap.state().devices.keys().collect::<Vec<_>>()
            );
            for (i, v) in snap.state().vcpus.iter().enumerate() {
                let pvm: Vec<String> = v
                    .msrs
                    .iter()
                    .filter(|m| cube_hypervisor::vstate::vcpu::PVM_MSRS.contains(&m.index))
                    .map(|m| format!("{:#x}={:#x}", m.index, m.data))
                    .collect();
                println!(
                    "vcpu {i}: rip {:#x}, {} MSRs saved (PVM MSRs: {pvm:?}), mp_state {}",
                    v.regs.rip,
                    v.msrs.len(),
                    v.mp_state.mp_state
                );
            }
            if verify_memory {
                snap.verify_memory()?;
                println!("memory checksum ok");
            }
        }
        Cmd::RunGuest {
            guest,
            vcpus,
            mem_mib,
            params,
            snapshot,
            timeout_secs,
        } => {
            let vmm = Vmm::new()?;
            let mut vm = vmm.create_vm(Shape::new(vcpus, mem_mib))?;
            vm.load_test_guest(guest_image(&guest)?)?;
            for (i, p) in params.iter().enumerate() {
                vm.write_u64(test_guests::PARAMS_ADDR + 8 * i as u64, *p)?;
            }
            let t = Instant::now();
            let rep = vm.run_until(Duration::from_secs(timeout_secs))?;
            eprintln!(
                "{:?} after {:?}, checkpoints {:x?}",
                rep.outcome,
                t.elapsed(),
                rep.checkpoints
            );
            println!("{}", serde_json::to_string_pretty(&vcpu_report(&vm)?)?);
            if let Some(dir) = snapshot {
                let m = vm.snapshot(&dir, &BTreeMap::new())?;
                eprintln!("snapshot written to {} ({} MiB)", dir.display(), m.mem_mib);
            }
            if let RunOutcome::Done(code) = rep.outcome {
                if code != 0 {
                    bail!("guest failed with code {code}");
                }
            }
        }
        Cmd::Restore {
            dir,
            run_ms,
            until_done,
            read,
            pause_to_disk,
            json,
        } => {
            let vmm = Vmm::new()?;
            let t = Instant::now();
            let snap = Snapshot::open(&dir).with_context(|| format!("open {}", dir.display()))?;
            let mut vm = restore(&vmm, &snap)?;
            let restore_us = t.elapsed().as_micros();
            let before = vcpu_report(&vm)?;
            let mut outcome = None;
            if until_done {
                outcome = Some(format!("{:?}", vm.run_until(Duration::from_secs(30))?));
            } else if run_ms > 0 {
                vm.resume()?;
                std::thread::sleep(Duration::from_millis(run_ms));
                vm.pause()?;
                while let Some((id, ev)) = vm.next_event(Duration::ZERO)? {
                    if let VcpuEvent::Error(e) = ev {
                        bail!("vCPU {id}: {e}");
                    }
                }
            }
            let after = vcpu_report(&vm)?;
            let mut report = serde_json::json!({
                "restore_us": restore_us,
                "before": before,
                "after": after,
                "outcome": outcome,
                "devices": snap.state().devices.iter()
                    .map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned()))
                    .collect::<BTreeMap<_, _>>(),
            });
            if let Some(spec) = read {
                let (a, l) = spec.split_once(':').context("--read wants ADDR:LEN")?;
                let mut buf = vec![0u8; l.parse::<usize>()?];
                vm.read_bytes(a.parse()?, &mut buf)?;
                report["read_crc32"] = crc32fast::hash(&buf).into();
            }
            if let Some(out) = pause_to_disk {
                let devices = snap.state().devices.clone();
                vm.pause_to_disk(&out, &devices)?;
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{}", serde_json::to_string_pretty(&report)?);
            }
        }
        Cmd::Boot {
            kernel,
            cmdline,
            initramfs,
            vcpus,
            mem_mib,
            secs,
            snapshot,
        } => {
            let vmm = Vmm::new()?;
            let mut vm = vmm.create_vm(Shape::new(vcpus, mem_mib))?;
            let irq = IrqLine::new(SERIAL_GSI)?;
            vm.register_irq(&irq)?;
            let serial = Arc::new(Mutex::new(Serial::new(irq, Box::new(std::io::stdout()))));
            vm.add_pio_device(SERIAL_PORT_BASE, SERIAL_PORT_LEN, serial.clone())?;
            let i8042 = I8042::new()?;
            let reset = i8042.reset_evt().try_clone()?;
            vm.add_pio_device(I8042_PORT_BASE, I8042_PORT_LEN, Arc::new(Mutex::new(i8042)))?;
            let entry = vm.load_kernel(&KernelConfig {
                kernel,
                cmdline,
                initramfs,
            })?;
            eprintln!(
                "kernel entry {:#x} ({:?}), digest {}",
                entry.entry, entry.mode, entry.digest
            );
            vm.resume()?;
            let deadline = (secs > 0).then(|| Instant::now() + Duration::from_secs(secs));
            let mut last_look = Instant::now();
            loop {
                if reset.read().is_ok() {
                    eprintln!("guest requested a reset");
                    break;
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                match vm.next_event(Duration::from_millis(100))? {
                    Some((id, VcpuEvent::Error(e))) => bail!("vCPU {id}: {e}"),
                    Some((_, VcpuEvent::Shutdown)) => {
                        eprintln!("guest shut down");
                        break;
                    }
                    Some(_) => {}
                    // A quiet guest may have powered off (no ACPI: every vCPU halts).
                    None if last_look.elapsed() >= HALT_LOOK_EVERY => {
                        last_look = Instant::now();
                        if vm.halted_for_good()? {
                            eprintln!("guest halted: every vCPU stopped with interrupts off");
                            break;
                        }
                    }
                    None => {}
                }
            }
            vm.pause()?;
            // Where the guest was when it stopped: how a stalled boot is diagnosed.
            for id in 0..usize::from(vcpus) {
                if let Ok(r) = vm.regs(id) {
                    eprintln!("vCPU {id} stopped at rip {:#x}", r.rip);
                }
            }
            if let Some(dir) = snapshot {
                let mut devices = BTreeMap::new();
                let state = serial
                    .lock()
                    .map_err(|_| anyhow::anyhow!("serial lock"))?
                    .state();
                devices.insert("serial".to_string(), serde_json::to_vec(&state)?);
                vm.snapshot(&dir, &devices)?;
                eprintln!("snapshot written to {}", dir.display());
            }
        }
    }
    Ok(())
}
