//! Assembles every `guests/*.asm` with `nasm -f bin` into `OUT_DIR/<name>.bin` and generates
//! `OUT_DIR/test_guests.rs` with one `pub const <NAME>: &[u8]` per guest.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let dir = PathBuf::from("guests");
    println!("cargo:rerun-if-changed=guests");
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
            .args(["-f", "bin", "-I", "guests/", "-o"])
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
    std::fs::write(out.join("test_guests.rs"), consts).expect("write test_guests.rs");
}
