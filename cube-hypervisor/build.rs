//! Assembles every `guests/*.asm` with `nasm -f bin` into `OUT_DIR/<name>.bin` and generates
//! `OUT_DIR/test_guests.rs` with one `pub const <NAME>: &[u8]` per guest.

#[path = "guests/assemble.rs"]
mod assemble;

fn main() {
    assemble::assemble_guests(&[], "test_guests.rs");
}
