//! Hostile guest against one virtio-mmio device: register writes, guest memory (descriptor
//! tables, rings) and backend input decoded from the fuzz input by
//! `cube_hypervisor::devices::fuzz_input`, which `cargo test` also replays with fixed seeds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cube_hypervisor::devices::fuzz_input::run(data);
});
