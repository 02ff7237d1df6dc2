//! Intel MultiProcessor Specification 1.4 table, so a kernel without ACPI finds its vCPUs,
//! the IOAPIC and the ISA interrupt routing.

use vm_memory::{Bytes, GuestAddress};

use super::layout::{IOAPIC_ADDR, LAPIC_ADDR, MPTABLE_ADDR};
use crate::error::{Error, Result};
use crate::vstate::memory::GuestMemory;

const IOAPIC_PINS: u8 = 24;

fn checksum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x)).wrapping_neg()
}

/// Builds the table bytes for `vcpus` processors, placed at `base`.
pub fn build(base: u64, vcpus: u8) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut count = 0u16;
    for id in 0..vcpus {
        let mut p = [0u8; 20];
        p[0] = 0; // processor
        p[1] = id;
        p[2] = 0x14;
        p[3] = 1 | if id == 0 { 2 } else { 0 };
        p[4..8].copy_from_slice(&0x600u32.to_le_bytes());
        p[8..12].copy_from_slice(&0x201u32.to_le_bytes()); // FPU + APIC
        entries.extend_from_slice(&p);
        count += 1;
    }
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    count += 1;
    let ioapic_id = vcpus + 1;
    let mut io = [2u8, ioapic_id, 0x11, 1, 0, 0, 0, 0];
    io[4..8].copy_from_slice(&(IOAPIC_ADDR as u32).to_le_bytes());
    entries.extend_from_slice(&io);
    count += 1;
    for pin in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, 0, 0, 0, 0, pin, ioapic_id, pin]);
        count += 1;
    }
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]); // ExtINT -> LINT0
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]); // NMI -> LINT1
    count += 2;

    let mut hdr = [0u8; 44];
    hdr[0..4].copy_from_slice(b"PCMP");
    let len = (44 + entries.len()) as u16;
    hdr[4..6].copy_from_slice(&len.to_le_bytes());
    hdr[6] = 4;
    hdr[8..16].copy_from_slice(b"CUBE    ");
    hdr[16..28].copy_from_slice(b"MICROVM     ");
    hdr[34..36].copy_from_slice(&count.to_le_bytes());
    hdr[36..40].copy_from_slice(&(LAPIC_ADDR as u32).to_le_bytes());
    let mut table = hdr.to_vec();
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&((base + 16) as u32).to_le_bytes());
    fp[8] = 1;
    fp[9] = 4;
    fp[10] = checksum(&fp);
    let mut out = fp.to_vec();
    out.extend_from_slice(&table);
    out
}

/// Writes the MP table at [`MPTABLE_ADDR`].
pub fn write(mem: &GuestMemory, vcpus: u8) -> Result<()> {
    let bytes = build(MPTABLE_ADDR, vcpus);
    mem.write_slice(&bytes, GuestAddress(MPTABLE_ADDR))
        .map_err(|e| Error::Load(format!("write MP table: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_are_valid() {
        let t = build(MPTABLE_ADDR, 4);
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
        let len = u16::from_le_bytes([t[20], t[21]]) as usize;
        assert_eq!(t.len(), 16 + len);
        assert_eq!(t[16..].iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
        // 4 processors + bus + ioapic + 24 pins + 2 local
        assert_eq!(u16::from_le_bytes([t[16 + 34], t[16 + 35]]), 32);
    }
}
