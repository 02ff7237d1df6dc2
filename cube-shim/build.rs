//! Assembles the shim's own test guests (`guests/*.asm`, nasm `-f bin`) into
//! `OUT_DIR/<name>.bin` and generates `OUT_DIR/shim_guests.rs` with one
//! `pub const <NAME>: &[u8]` per guest. The guests use the hypervisor's test-guest ABI, so its
//! `guests/` directory is on the include path (read only).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let dir = PathBuf::from("guests");
    let hv_include = "../cube-hypervisor/guests/";
    println!("cargo:rerun-if-changed=guests");
    println!("cargo:rerun-if-changed={hv_include}abi.inc");
    println!("cargo:rerun-if-changed={hv_include}virtio_driver.inc");
    let mut names = Vec::new();
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) == Some("asm") {
                println!("cargo:rerun-if-changed={}", p.display());
                names.push(p);
            }
        }
    }
    names.sort();
    let mut consts = String::new();
    for p in &names {
        let stem = p
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 guest name");
        let bin = out.join(format!("{stem}.bin"));
        let st = Command::new("nasm")
            .args(["-f", "bin", "-I", "guests/", "-I", hv_include, "-o"])
            .arg(&bin)
            .arg(p)
            .status()
            .unwrap_or_else(|e| {
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
    std::fs::write(out.join("shim_guests.rs"), consts).expect("write shim_guests.rs");
}
