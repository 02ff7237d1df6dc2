//! Hostile guest against one virtio-mmio device: register writes, guest memory (descriptor
//! tables, rings) and backend input decoded from the fuzz input by
//! `cube_hypervisor::devices::fuzz_input`, which `cargo test` also replays with fixed seeds.
//!
//! With CUBE_FUZZ_SEEDS=DIR the target first writes those seeds into DIR (the corpus libFuzzer
//! then reads), so a run always starts from the seeds the code has now (`../run.sh`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        if let Some(dir) = std::env::var_os("CUBE_FUZZ_SEEDS") {
            let dir = std::path::PathBuf::from(dir);
            std::fs::create_dir_all(&dir).expect("seed directory");
            for (name, bytes) in cube_hypervisor::devices::fuzz_input::seeds() {
                let file = format!("seed-{}", name.replace(|c: char| !c.is_ascii_alphanumeric(), "-"));
                std::fs::write(dir.join(file), bytes).expect("write seed");
            }
        }
    },
    |data: &[u8]| {
        cube_hypervisor::devices::fuzz_input::run(data);
    }
);
