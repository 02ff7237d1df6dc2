//! Assembles the shim's own test guests (`guests/*.asm`, nasm `-f bin`) into
//! `OUT_DIR/<name>.bin` and generates `OUT_DIR/shim_guests.rs` with one
//! `pub const <NAME>: &[u8]` per guest. The guests use the hypervisor's test-guest ABI, so its
//! `guests/` directory is on the include path (read only), and its assembler helper is reused.

#[path = "../cube-hypervisor/guests/assemble.rs"]
mod assemble;

fn main() {
    assemble::assemble_guests(&["../cube-hypervisor/guests/"], "shim_guests.rs");
}
