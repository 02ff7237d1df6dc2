//! Pre-created VM shells: a KVM VM with its memslot (on an anonymous placeholder mapping of the
//! right size) and parked vCPU threads, created ahead of time so that a restore only has to map
//! the memory file over the placeholder and load state ([`crate::snapshot::restore_into`]).
//! Memslot registration dominates a cold restore on this kind of host (6–22 ms), so keep a pool.

use crate::error::Result;
use crate::vmm::{Shape, Vm, Vmm};

/// A VM ready to receive a snapshot of the same shape. One shell serves one restore.
pub struct VmShell {
    pub(crate) vm: Vm,
    /// Set by [`VmShell::prepare`]: the snapshot files already mapped over the placeholder.
    pub(crate) prepared_for: Option<crate::snapshot::FileIdentity>,
}

impl VmShell {
    pub fn new(vmm: &Vmm, shape: Shape) -> Result<VmShell> {
        Ok(VmShell {
            vm: Vm::create(vmm, shape)?,
            prepared_for: None,
        })
    }

    pub fn shape(&self) -> Shape {
        self.vm.shape()
    }
}
