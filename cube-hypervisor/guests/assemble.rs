//! Build-script helper shared by cube-hypervisor's and cube-shim's `build.rs` (both include it
//! with `#[path]`): assembles every `guests/*.asm` of the calling crate with `nasm -f bin` into
//! `OUT_DIR/<name>.bin` and writes `OUT_DIR/<consts_file>` with one `pub const <NAME>: &[u8]`
//! per guest.

use std::path::PathBuf;
use std::process::Command;

/// `include_dirs` are extra nasm include paths (each ending in `/`); their `.inc` files are
/// watched too.
pub fn assemble_guests(include_dirs: &[&str], consts_file: &str) {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    println!("cargo:rerun-if-changed=guests");
    for inc in include_dirs {
        println!("cargo:rerun-if-changed={inc}");
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir("guests")
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    names.retain(|p| p.extension().and_then(|x| x.to_str()) == Some("asm"));
    names.sort();
    let mut consts = String::new();
    for p in &names {
        println!("cargo:rerun-if-changed={}", p.display());
        let stem = p
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 guest name");
        let bin = out.join(format!("{stem}.bin"));
        let mut cmd = Command::new("nasm");
        cmd.args(["-f", "bin", "-I", "guests/"]);
        for inc in include_dirs {
            cmd.args(["-I", inc]);
        }
        let st = cmd.arg("-o").arg(&bin).arg(p).status().unwrap_or_else(|e| {
            panic!("running nasm for {} (is nasm installed?): {e}", p.display())
        });
        assert!(st.success(), "nasm failed on {}", p.display());
        let ident: String = stem
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect();
        consts.push_str(&format!(
            "/// Assembled from `guests/{stem}.asm`.\npub const {ident}: &[u8] = include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{stem}.bin\"));\n"
        ));
    }
    std::fs::write(out.join(consts_file), consts).expect("write the guest constants");
}
