//! Cube's KVM microVM monitor: boot a guest once, snapshot its complete state, restore copies of
//! it into pre-created VM shells, pause and resume.
//!
//! # Runner API (stable; used by the device tests)
//! ```no_run
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//! use cube_hypervisor::{test_guests, RunOutcome, Shape, Vmm};
//! # fn main() -> cube_hypervisor::Result<()> {
//! let vmm = Vmm::new()?;                                   // opens /dev/kvm (once per process)
//! let mut vm = vmm.create_vm(Shape::new(1, 64))?;          // 1 vCPU, 64 MiB, all paused
//! vm.load_test_guest(test_guests::PATTERN)?;               // CPL3 guest at 1 MiB (ABI: test_guests)
//! vm.write_u64(test_guests::PARAMS_ADDR, 4096)?;           // parameters for the guest
//! // devices: vm.add_mmio_device(0xc000_1000, 0x1000, Arc::new(Mutex::new(dev)))?;
//! //          vm.register_irq(&irq_line)?;   (KVM irqfd for the device's IrqLine)
//! let report = vm.run_until(Duration::from_secs(10))?;    // runs until done / pause point
//! assert_eq!(report.outcome, RunOutcome::PausePoint(1));
//! let regs = vm.regs(0)?;                                   // VM is paused again here
//! let word = vm.read_u64(test_guests::DATA_ADDR)?;
//! # let _ = (regs, word); Ok(()) }
//! ```
//!
//! # Snapshot / restore
//! [`Vm::snapshot`] writes `manifest.json`, `vmstate.bin`, `memory.img`; [`Snapshot::open`]
//! verifies; [`restore_into`] restores into a [`VmShell`] created ahead of time;
//! [`Vm::pause_to_disk`] writes only pages that differ from the VM's base memory file.
//! Device state travels as opaque named blobs ([`snapshot::DeviceStates`]) that the device
//! owner serializes from each device's `state()` and restores with new backends.

pub mod arch;
pub mod devices;
pub mod error;
pub mod loader;
pub mod shell;
pub mod snapshot;
pub mod test_guests;
pub mod vmm;
pub mod vstate;

pub use error::{Error, Result, SnapshotError};
pub use shell::VmShell;
pub use snapshot::{restore, restore_into, DeviceStates, Manifest, Snapshot};
pub use vmm::{RunOutcome, RunReport, Shape, Vm, Vmm};
pub use vstate::memory::GuestMemory;
pub use vstate::vcpu::VcpuEvent;
