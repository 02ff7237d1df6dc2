//! A device's state travels through a snapshot and is rebound to a new backend on restore.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use cube_hypervisor::devices::irq::IrqLine;
use cube_hypervisor::devices::legacy::{
    Serial, SerialState, SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN,
};
use cube_hypervisor::{restore_into, test_guests, RunOutcome, Shape, Snapshot, VmShell, Vmm};

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[test]
fn serial_state_survives_a_snapshot_and_output_goes_to_the_new_backend() {
    cube_testkit::require_kvm!(
        "serial_state_survives_a_snapshot_and_output_goes_to_the_new_backend"
    );
    let vmm = Vmm::new().unwrap();
    let dir = tmpdir("serial");
    let shape = Shape::new(1, 8);
    let mut vm = vmm.create_vm(shape).unwrap();
    let first = Sink::default();
    let irq = IrqLine::new(SERIAL_GSI).unwrap();
    vm.register_irq(&irq).unwrap();
    let serial = Arc::new(Mutex::new(Serial::new(irq, Box::new(first.clone()))));
    vm.add_pio_device(SERIAL_PORT_BASE, SERIAL_PORT_LEN, serial.clone())
        .unwrap();
    vm.load_test_guest(test_guests::SERIAL).unwrap();
    assert_eq!(
        vm.run_until(TIMEOUT).unwrap().outcome,
        RunOutcome::PausePoint(1)
    );
    assert_eq!(first.text(), "before|");
    let mut devices = BTreeMap::new();
    devices.insert(
        "serial".to_string(),
        serde_json::to_vec(&serial.lock().unwrap().state()).unwrap(),
    );
    vm.snapshot(dir.path(), &devices).unwrap();
    drop(vm);

    let snap = Snapshot::open(dir.path()).unwrap();
    let mut vm = restore_into(VmShell::new(&vmm, shape).unwrap(), &snap).unwrap();
    let state: SerialState = serde_json::from_slice(snap.device_state("serial").unwrap()).unwrap();
    let second = Sink::default();
    let irq = IrqLine::new(SERIAL_GSI).unwrap();
    vm.register_irq(&irq).unwrap();
    let serial = Serial::restore(&state, irq, Box::new(second.clone())).unwrap();
    vm.add_pio_device(
        SERIAL_PORT_BASE,
        SERIAL_PORT_LEN,
        Arc::new(Mutex::new(serial)),
    )
    .unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(r.outcome, RunOutcome::Done(0));
    assert_eq!(
        r.checkpoints,
        vec![0x5a, 0x03],
        "scratch and LCR registers restored"
    );
    assert_eq!(second.text(), "after");
    assert_eq!(
        first.text(),
        "before|",
        "the old backend sees nothing after the snapshot"
    );
}
