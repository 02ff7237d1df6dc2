//! On-disk formats: `vmstate.bin` (magic, version, length, CRC32 over the payload, then the
//! bincode payload) and `manifest.json` (what restore checks before touching KVM).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{snap, Result, SnapshotError};
use crate::vstate::vcpu::VcpuState;
use crate::vstate::vm::VmState;

pub const VMSTATE_MAGIC: [u8; 8] = *b"CUBEVMS\x01";
/// Version of both `vmstate.bin` and `manifest.json`.
pub const FORMAT_VERSION: u32 = 1;
pub const VMSTATE_FILE: &str = "vmstate.bin";
pub const MEMORY_FILE: &str = "memory.img";
pub const DIFF_FILE: &str = "memory.diff";
pub const MANIFEST_FILE: &str = "manifest.json";
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 4 + 4;
/// Upper bound on a state payload (a few vCPUs are ~15 KiB each): refuse absurd lengths
/// before allocating.
const MAX_PAYLOAD: u64 = 64 << 20;

/// Everything but guest memory.
#[derive(Debug, Serialize, Deserialize)]
pub struct VmSnapshotState {
    pub vcpus: Vec<VcpuState>,
    pub vm: VmState,
    /// Device states by name, as the device owner serialized them (e.g. JSON of `state()`).
    pub devices: BTreeMap<String, Vec<u8>>,
}

/// Where guest memory comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemoryRef {
    /// `memory.img` holds all of guest RAM.
    Full { size: u64, crc32: u32 },
    /// Pause-to-disk image: the base snapshot's memory file plus the pages in `memory.diff`
    /// (a sparse file of the full size; only `runs` (first page, pages) hold data).
    Diff {
        base_path: PathBuf,
        base_size: u64,
        base_crc32: u32,
        runs: Vec<(u64, u64)>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub vmm_version: String,
    pub cpu_model_hash: String,
    pub vcpus: u8,
    pub mem_mib: u32,
    pub kernel_digest: Option<String>,
    pub created_unix: u64,
    pub vmstate_crc32: u32,
    pub memory: MemoryRef,
}

/// bincode with fixed-width integers and an allocation limit, so a crafted length prefix in a
/// (checksum-valid) payload cannot make the decoder allocate without bound.
fn codec() -> impl bincode::Options {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .with_limit(MAX_PAYLOAD)
}

pub fn encode_state(state: &VmSnapshotState) -> Result<(Vec<u8>, u32)> {
    use bincode::Options;
    let payload = codec().serialize(state).map_err(|e| {
        snap(
            "vmstate",
            SnapshotError::Malformed(format!("serialize: {e}")),
        )
    })?;
    let crc = crc32fast::hash(&payload);
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&VMSTATE_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&payload);
    Ok((out, crc))
}

pub fn decode_state(path: &Path, bytes: &[u8]) -> Result<(VmSnapshotState, u32)> {
    let bad = |k| snap(path, k);
    if bytes.len() < HEADER_LEN {
        return Err(bad(SnapshotError::Malformed("vmstate header".into())));
    }
    if bytes[0..8] != VMSTATE_MAGIC {
        return Err(bad(SnapshotError::BadMagic));
    }
    let u32_at =
        |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
    let version = u32_at(8);
    if version != FORMAT_VERSION {
        return Err(bad(SnapshotError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        }));
    }
    let mut l = [0u8; 8];
    l.copy_from_slice(&bytes[16..24]);
    let len = u64::from_le_bytes(l);
    if len > MAX_PAYLOAD || len != (bytes.len() - HEADER_LEN) as u64 {
        return Err(bad(SnapshotError::Malformed(format!(
            "vmstate payload length {len} vs {} bytes present",
            bytes.len() - HEADER_LEN
        ))));
    }
    let stored = u32_at(24);
    let payload = &bytes[HEADER_LEN..];
    let computed = crc32fast::hash(payload);
    if stored != computed {
        return Err(bad(SnapshotError::Checksum {
            file: VMSTATE_FILE.into(),
            stored: stored as u64,
            computed: computed as u64,
        }));
    }
    use bincode::Options;
    let state: VmSnapshotState = codec()
        .deserialize(payload)
        .map_err(|e| bad(SnapshotError::Malformed(format!("vmstate payload: {e}"))))?;
    Ok((state, computed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_checks_refuse_garbage_without_panicking() {
        let p = Path::new("x");
        let kind = |r: Result<(VmSnapshotState, u32)>| match r {
            Err(crate::Error::Snapshot { kind, .. }) => kind,
            other => panic!("expected a snapshot error, got {other:?}"),
        };
        assert!(matches!(
            kind(decode_state(p, b"short")),
            SnapshotError::Malformed(_)
        ));
        let mut b = vec![0u8; 64];
        assert_eq!(kind(decode_state(p, &b)), SnapshotError::BadMagic);
        b[0..8].copy_from_slice(&VMSTATE_MAGIC);
        b[8] = 9;
        assert!(matches!(
            kind(decode_state(p, &b)),
            SnapshotError::UnsupportedVersion { found: 9, .. }
        ));
        b[8] = FORMAT_VERSION as u8;
        b[16] = 32; // claims 32 payload bytes, 32 present, checksum 0 is wrong
        assert!(matches!(
            kind(decode_state(p, &b)),
            SnapshotError::Checksum { .. }
        ));
        // right checksum, garbage payload
        let crc = crc32fast::hash(&b[32..]);
        b[24..28].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            kind(decode_state(p, &b)),
            SnapshotError::Malformed(_)
        ));
        // absurd length
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            kind(decode_state(p, &b)),
            SnapshotError::Malformed(_)
        ));
    }
}
