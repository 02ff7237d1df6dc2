//! VM-wide KVM state: in-kernel irqchip (PIC master/slave, IOAPIC), PIT and the kvmclock.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_config, kvm_pit_state2, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use serde::{Deserialize, Serialize};

use crate::error::{kvm, Error, Result, SnapshotError};

/// Address of the three-page TSS region KVM needs on Intel; out of the way under 4 GiB.
const TSS_REGION: usize = 0xfffb_d000;

/// VM-wide state of the in-kernel devices.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmState {
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
}

/// Creates a VM with the in-kernel irqchip and PIT (both before any vCPU, as KVM requires).
pub fn create_vm(kvm_sys: &Kvm) -> Result<VmFd> {
    let vm = kvm_sys.create_vm().map_err(kvm("KVM_CREATE_VM"))?;
    vm.set_tss_address(TSS_REGION)
        .map_err(kvm("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip().map_err(kvm("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(kvm("KVM_CREATE_PIT2"))?;
    Ok(vm)
}

fn chip(vm: &VmFd, id: u32) -> Result<kvm_irqchip> {
    let mut c = kvm_irqchip {
        chip_id: id,
        ..Default::default()
    };
    vm.get_irqchip(&mut c).map_err(kvm("KVM_GET_IRQCHIP"))?;
    Ok(c)
}

pub fn save_state(vm: &VmFd) -> Result<VmState> {
    let pit = vm.get_pit2().map_err(kvm("KVM_GET_PIT2"))?;
    let mut clock = vm.get_clock().map_err(kvm("KVM_GET_CLOCK"))?;
    // Only the value matters on load; the flags describe how it was read.
    clock.flags = 0;
    Ok(VmState {
        pit,
        clock,
        pic_master: chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: chip(vm, KVM_IRQCHIP_IOAPIC)?,
    })
}

pub fn restore_state(vm: &VmFd, s: &VmState) -> Result<()> {
    let rej = |op: &str, e: kvm_ioctls::Error| Error::Snapshot {
        path: Default::default(),
        kind: SnapshotError::StateRejected(format!("{op}: {e}")),
    };
    vm.set_pit2(&s.pit).map_err(|e| rej("KVM_SET_PIT2", e))?;
    vm.set_clock(&s.clock)
        .map_err(|e| rej("KVM_SET_CLOCK", e))?;
    for (c, id) in [
        (&s.pic_master, KVM_IRQCHIP_PIC_MASTER),
        (&s.pic_slave, KVM_IRQCHIP_PIC_SLAVE),
        (&s.ioapic, KVM_IRQCHIP_IOAPIC),
    ] {
        if c.chip_id != id {
            return Err(Error::Snapshot {
                path: Default::default(),
                kind: SnapshotError::Malformed(format!(
                    "irqchip id {} where {id} expected",
                    c.chip_id
                )),
            });
        }
        vm.set_irqchip(c).map_err(|e| rej("KVM_SET_IRQCHIP", e))?;
    }
    Ok(())
}
