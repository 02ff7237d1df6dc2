//! Emulated devices: legacy (serial, i8042) and virtio-mmio (block, net, vsock).
