//! Emulated devices: legacy (serial, i8042) and virtio-mmio (block, net, vsock).
//!
//! Every device is a [`bus::BusDevice`] that the VMM places on its PIO or MMIO [`bus::Bus`] and
//! drives from vCPU exits. Interrupts leave through an [`irq::IrqLine`] (an eventfd the VMM
//! registers as a KVM irqfd). Virtio devices whose backend produces input on its own (net rx,
//! vsock host connections) are driven either by calling
//! [`virtio::MmioTransport::process_backend`] from the VMM's event loop when one of
//! [`virtio::MmioTransport::backend_fds`] is readable, or by a [`virtio::BackendWorker`]
//! thread that does exactly that (with `pause()`/`resume()` for snapshots).

pub mod bus;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz_input;
pub mod irq;
pub mod legacy;
pub mod virtio;
