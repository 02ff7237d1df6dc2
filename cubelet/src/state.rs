//! Versioned, checksummed JSON files for state that must survive a cubelet restart.
//!
//! Envelope: `{"magic": "...", "version": N, "sha256": "<hex of body bytes>", "body": {...}}`.
//! The checksum covers the body's serialized bytes, so a torn or hand-edited file is detected
//! and treated as half-created state (reaped), never trusted.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::Path;

/// Errors reading or writing a state file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("state file {path}: not JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("state file {path}: magic {found:?}, expected {expected:?}")]
    Magic {
        path: String,
        found: String,
        expected: String,
    },
    #[error("state file {path}: version {found} not supported (this cubelet reads {expected})")]
    Version {
        path: String,
        found: u32,
        expected: u32,
    },
    #[error("state file {path}: checksum mismatch")]
    Checksum { path: String },
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    magic: String,
    version: u32,
    sha256: String,
    body: Box<serde_json::value::RawValue>,
}

/// Hex SHA-256 of bytes.
pub fn sha256_hex(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    hex(&d)
}

/// Lower-case hex encoding.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Writes `body` atomically (temp file + rename). No fsync: the file must survive a crash of
/// cubelet (the page cache does), and sandboxes do not survive a host crash anyway.
pub fn write<T: Serialize>(
    path: &Path,
    magic: &str,
    version: u32,
    body: &T,
) -> Result<(), StateError> {
    let p = path.display().to_string();
    let raw = serde_json::to_string(body).map_err(|e| StateError::Json {
        path: p.clone(),
        source: e,
    })?;
    let env = Envelope {
        magic: magic.to_string(),
        version,
        sha256: sha256_hex(raw.as_bytes()),
        body: serde_json::value::RawValue::from_string(raw).map_err(|e| StateError::Json {
            path: p.clone(),
            source: e,
        })?,
    };
    let text = serde_json::to_vec_pretty(&env).map_err(|e| StateError::Json {
        path: p.clone(),
        source: e,
    })?;
    let tmp = path.with_extension("tmp");
    let io = |e| StateError::Io {
        path: p.clone(),
        source: e,
    };
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&text).map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

/// Reads and verifies a state file.
pub fn read<T: DeserializeOwned>(path: &Path, magic: &str, version: u32) -> Result<T, StateError> {
    let (_, body) = read_versions(path, magic, version..=version)?;
    serde_json::from_str(&body).map_err(|e| StateError::Json {
        path: path.display().to_string(),
        source: e,
    })
}

/// Reads and verifies a state file written in any of `versions`: its version and body, for
/// the caller to migrate older ones.
pub fn read_versions(
    path: &Path,
    magic: &str,
    versions: std::ops::RangeInclusive<u32>,
) -> Result<(u32, String), StateError> {
    let p = path.display().to_string();
    let text = std::fs::read(path).map_err(|e| StateError::Io {
        path: p.clone(),
        source: e,
    })?;
    let env: Envelope = serde_json::from_slice(&text).map_err(|e| StateError::Json {
        path: p.clone(),
        source: e,
    })?;
    if env.magic != magic {
        return Err(StateError::Magic {
            path: p,
            found: env.magic,
            expected: magic.into(),
        });
    }
    if !versions.contains(&env.version) {
        return Err(StateError::Version {
            path: p,
            found: env.version,
            expected: *versions.end(),
        });
    }
    if sha256_hex(env.body.get().as_bytes()) != env.sha256 {
        return Err(StateError::Checksum { path: p });
    }
    Ok((env.version, env.body.get().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct S {
        a: u32,
        b: String,
    }

    #[test]
    fn round_trip_and_tamper_detection() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.json");
        let s = S {
            a: 7,
            b: "x".into(),
        };
        write(&p, "m", 1, &s).unwrap();
        assert_eq!(read::<S>(&p, "m", 1).unwrap(), s);
        assert!(matches!(
            read::<S>(&p, "other", 1),
            Err(StateError::Magic { .. })
        ));
        assert!(matches!(
            read::<S>(&p, "m", 2),
            Err(StateError::Version { .. })
        ));
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"a\":7", "\"a\":8");
        std::fs::write(&p, text).unwrap();
        assert!(matches!(
            read::<S>(&p, "m", 1),
            Err(StateError::Checksum { .. })
        ));
        std::fs::write(&p, b"{not json").unwrap();
        assert!(matches!(
            read::<S>(&p, "m", 1),
            Err(StateError::Json { .. })
        ));
    }
}
