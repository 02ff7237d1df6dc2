//! Interrupt lines: an eventfd per GSI that the VMM wires to KVM with `register_irqfd`.

use std::io;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// One edge-triggered interrupt line. Writing the eventfd makes KVM inject GSI `gsi`.
#[derive(Debug)]
pub struct IrqLine {
    gsi: u32,
    evt: EventFd,
}

impl IrqLine {
    /// A new line for `gsi` with a fresh non-blocking eventfd.
    pub fn new(gsi: u32) -> io::Result<Self> {
        Ok(IrqLine {
            gsi,
            evt: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// The guest interrupt number this line raises.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }

    /// The eventfd to register with `VmFd::register_irqfd(evt, gsi)`.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// Raises the interrupt.
    pub fn trigger(&self) -> io::Result<()> {
        self.evt.write(1)
    }

    /// A second handle on the same eventfd (same GSI).
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(IrqLine {
            gsi: self.gsi,
            evt: self.evt.try_clone()?,
        })
    }

    /// Consumes pending triggers and returns how many there were (0 when none). Used by tests
    /// and by VMMs that poll the line instead of using an irqfd.
    pub fn take_count(&self) -> u64 {
        self.evt.read().unwrap_or(0)
    }
}

impl vm_superio::Trigger for IrqLine {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        IrqLine::trigger(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_counts() {
        let irq = IrqLine::new(5).unwrap();
        assert_eq!(irq.gsi(), 5);
        assert_eq!(irq.take_count(), 0);
        irq.trigger().unwrap();
        irq.try_clone().unwrap().trigger().unwrap();
        assert_eq!(irq.take_count(), 2);
        assert_eq!(irq.take_count(), 0);
    }
}
