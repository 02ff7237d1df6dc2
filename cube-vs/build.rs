//! Compiles `bpf/cubevs.c` with clang into `$OUT_DIR/cubevs.o`, which the crate embeds.
//!
//! Without clang the crate still builds (so that machines without the toolchain can build the
//! rest of the workspace): it embeds an empty object, prints a cargo warning, and
//! `Switch::open` then returns `Error::NoDatapath`. Privileged tests fail under
//! `CUBE_REQUIRE_PRIV=1` in that case, so CI cannot go green without the datapath.
//! `CUBEVS_REQUIRE_BPF=1` turns the warning into a build failure.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let obj = out.join("cubevs.o");
    let src = "bpf/cubevs.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CUBEVS_CLANG");
    println!("cargo:rerun-if-env-changed=CUBEVS_REQUIRE_BPF");
    let clang = std::env::var("CUBEVS_CLANG").unwrap_or_else(|_| "clang".to_string());
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    // Debian keeps asm/ in the multiarch directory.
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    let result = Command::new(&clang)
        .args([
            "-O2", "-g", "-Wall", "-target", "bpf", &multiarch, "-c", src, "-o",
        ])
        .arg(&obj)
        .output();
    let failure = match result {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{clang} failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run {clang}: {e}")),
    };
    if let Some(why) = failure {
        if std::env::var("CUBEVS_REQUIRE_BPF").is_ok_and(|v| v == "1") {
            panic!("cannot build the eBPF object ({why}); install clang and libbpf-dev");
        }
        println!(
            "cargo:warning=eBPF object not built ({}); cube-vs datapath unavailable, privileged tests will skip or fail",
            why.lines().next().unwrap_or_default()
        );
        std::fs::write(&obj, []).expect("write empty object");
    }
}
