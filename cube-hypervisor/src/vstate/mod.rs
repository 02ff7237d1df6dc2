//! KVM state of a VM: guest memory, vCPUs (state + threads) and VM-wide irqchip/PIT/clock.

pub mod memory;
pub mod vcpu;
pub mod vm;
pub mod xstate;
