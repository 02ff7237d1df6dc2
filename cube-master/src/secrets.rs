//! E2B secrets (`/secrets`): write-only values, sealed at rest with AES-256-GCM under the
//! master's secrets key (a file outside the database, like the token key) and never opened
//! by any read path. A row holds the team, the name, the current version, the metadata and
//! the sealed current value; the associated data binds the sealed value to its row
//! (team, id, version), so a value copied into another row does not open.
//!
//! This module is the key and the checks; the operations are in [`crate::ops::secrets`], the
//! rows in [`crate::store::secrets`].

use crate::error::MasterError;
use base64::Engine;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use std::collections::BTreeMap;
use std::path::Path;

/// Prefix of a sealed value: the format's version.
const SEALED_V1: &str = "v1:";
/// Prefix of secret ids; names may not start with it, so an id or a name is never ambiguous.
pub const ID_PREFIX: &str = "sec_";
/// Longest name, in bytes.
pub const MAX_NAME: usize = 256;
/// Longest value, in bytes.
pub const MAX_VALUE: usize = 64 * 1024;
/// Metadata limits (E2B's, as the SDK documents them).
pub const MAX_META_ENTRIES: usize = 32;
pub const MAX_META_KEY: usize = 128;
pub const MAX_META_VALUE: usize = 1024;
pub const MAX_META_TOTAL: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum SecretsKeyError {
    #[error("secrets key {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("secrets key {path}: is {len} bytes, a secrets key is exactly 32")]
    Size { path: String, len: usize },
}

/// The master's key for sealing secret values.
#[derive(Clone)]
pub struct SecretsKey([u8; 32]);

impl std::fmt::Debug for SecretsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsKey(..)")
    }
}

fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| std::io::Error::other("the system's random source failed"))?;
    Ok(b)
}

/// The associated data of a sealed value: the row it belongs to.
fn aad(team: &str, id: &str, version: i64) -> Vec<u8> {
    format!("{team}\0{id}\0{version}").into_bytes()
}

impl SecretsKey {
    /// A key for this process only (tests; nothing sealed with it opens after a restart).
    pub fn random() -> SecretsKey {
        // At construction only (never on a request path), like the token key's.
        SecretsKey(random_bytes().expect("the system's random source"))
    }

    /// Reads the key file (32 raw bytes), creating it (mode 0600) when absent; a file of any
    /// other size is refused. Several masters of one fleet must share the file.
    pub fn load_or_create(path: &Path) -> Result<SecretsKey, SecretsKeyError> {
        let p = path.display().to_string();
        let io = |source| SecretsKeyError::Io {
            path: p.clone(),
            source,
        };
        let from = |raw: Vec<u8>| {
            let len = raw.len();
            <[u8; 32]>::try_from(raw)
                .map(SecretsKey)
                .map_err(|_| SecretsKeyError::Size {
                    path: p.clone(),
                    len,
                })
        };
        match std::fs::read(path) {
            Ok(raw) => from(raw),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                if let Some(d) = path.parent() {
                    std::fs::create_dir_all(d).map_err(io)?;
                }
                let k: [u8; 32] = random_bytes().map_err(io)?;
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                {
                    Ok(mut f) => {
                        f.write_all(&k).map_err(io)?;
                        f.sync_all().map_err(io)?;
                        Ok(SecretsKey(k))
                    }
                    // Another master created it meanwhile: use theirs.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        from(std::fs::read(path).map_err(io)?)
                    }
                    Err(e) => Err(io(e)),
                }
            }
            Err(e) => Err(io(e)),
        }
    }

    fn aead(&self) -> LessSafeKey {
        LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, &self.0)
                .unwrap_or_else(|_| unreachable!("32 bytes is an AES-256 key")),
        )
    }

    /// `v1:<base64(nonce || ciphertext || tag)>` of `value` for the row (team, id, version).
    pub fn seal(
        &self,
        team: &str,
        id: &str,
        version: i64,
        value: &[u8],
    ) -> Result<String, MasterError> {
        let nonce: [u8; NONCE_LEN] =
            random_bytes().map_err(|e| MasterError::Internal(format!("sealing a secret: {e}")))?;
        let mut buf = value.to_vec();
        self.aead()
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(team, id, version)),
                &mut buf,
            )
            .unwrap_or_else(|_| unreachable!("a value under 64 KiB always seals"));
        let mut out = nonce.to_vec();
        out.extend_from_slice(&buf);
        Ok(format!(
            "{SEALED_V1}{}",
            base64::engine::general_purpose::STANDARD.encode(out)
        ))
    }

    /// The value sealed for (team, id, version); `None` when it does not open (another key,
    /// another row, damaged). Nothing reads values yet: the tests use it.
    #[cfg(test)]
    pub fn open(&self, team: &str, id: &str, version: i64, sealed: &str) -> Option<Vec<u8>> {
        let b64 = sealed.strip_prefix(SEALED_V1)?;
        let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        if raw.len() < NONCE_LEN {
            return None;
        }
        let (n, ct) = raw.split_at(NONCE_LEN);
        let mut buf = ct.to_vec();
        let pt = self
            .aead()
            .open_in_place(
                Nonce::try_assume_unique_for_key(n).ok()?,
                Aad::from(aad(team, id, version)),
                &mut buf,
            )
            .ok()?;
        Some(pt.to_vec())
    }
}

fn bad(m: String) -> MasterError {
    MasterError::InvalidArgument(m)
}

/// The stored (canonical, lower-cased) form of a name, checked: non-empty, at most
/// [`MAX_NAME`] bytes, no `{`, `}` or control characters (it is interpolated into
/// `${e2b.secrets.<name>}`), and not starting with [`ID_PREFIX`].
pub fn check_name(name: &str) -> Result<String, MasterError> {
    if name.is_empty() {
        return Err(bad("name must not be empty".into()));
    }
    if name.len() > MAX_NAME {
        return Err(bad(format!("name is longer than {MAX_NAME} bytes")));
    }
    if name.chars().any(|c| c == '{' || c == '}' || c.is_control()) {
        return Err(bad(
            "name cannot contain '{', '}' or control characters".into()
        ));
    }
    let name = name.to_lowercase();
    if name.starts_with(ID_PREFIX) {
        return Err(bad(format!(
            "name cannot start with {ID_PREFIX:?} (reserved for secret ids)"
        )));
    }
    Ok(name)
}

pub fn check_value(value: &str) -> Result<(), MasterError> {
    if value.is_empty() {
        return Err(bad("value must not be empty".into()));
    }
    if value.len() > MAX_VALUE {
        return Err(bad(format!("value is longer than {MAX_VALUE} bytes")));
    }
    Ok(())
}

pub fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), MasterError> {
    if m.len() > MAX_META_ENTRIES {
        return Err(bad(format!(
            "metadata has more than {MAX_META_ENTRIES} entries"
        )));
    }
    let mut total = 0;
    for (k, v) in m {
        if k.is_empty() {
            return Err(bad("metadata keys must not be empty".into()));
        }
        if k.len() > MAX_META_KEY {
            return Err(bad(format!(
                "metadata key is longer than {MAX_META_KEY} bytes"
            )));
        }
        if v.len() > MAX_META_VALUE {
            return Err(bad(format!(
                "metadata.{k} is longer than {MAX_META_VALUE} bytes"
            )));
        }
        total += k.len() + v.len();
    }
    if total > MAX_META_TOTAL {
        return Err(bad(format!(
            "metadata is larger than {MAX_META_TOTAL} bytes in total"
        )));
    }
    Ok(())
}

/// `sec_` and 20 lowercase alphanumerics.
pub fn new_secret_id() -> String {
    crate::ids::random_id(ID_PREFIX, 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_round_trip_and_no_plaintext() {
        let k = SecretsKey::random();
        let s = k.seal("team", "sec_x", 1, b"hunter2-plaintext").unwrap();
        assert!(s.starts_with("v1:"), "{s}");
        assert!(!s.contains("hunter2"), "{s}");
        assert_eq!(
            k.open("team", "sec_x", 1, &s).as_deref(),
            Some(&b"hunter2-plaintext"[..])
        );
        // A fresh nonce each time.
        assert_ne!(s, k.seal("team", "sec_x", 1, b"hunter2-plaintext").unwrap());
    }

    #[test]
    fn another_row_or_key_does_not_open() {
        let k = SecretsKey::random();
        let s = k.seal("team", "sec_x", 3, b"v").unwrap();
        assert!(k.open("other", "sec_x", 3, &s).is_none());
        assert!(k.open("team", "sec_y", 3, &s).is_none());
        assert!(k.open("team", "sec_x", 4, &s).is_none());
        assert!(SecretsKey::random().open("team", "sec_x", 3, &s).is_none());
        assert!(k.open("team", "sec_x", 3, "v2:AAAA").is_none());
        assert!(k.open("team", "sec_x", 3, "v1:AAAA").is_none());
        // Any bit flipped is refused.
        let mut raw = base64::engine::general_purpose::STANDARD
            .decode(&s[3..])
            .unwrap();
        raw[NONCE_LEN] ^= 1;
        let flipped = format!(
            "v1:{}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        );
        assert!(k.open("team", "sec_x", 3, &flipped).is_none());
    }

    #[test]
    fn key_file_is_created_0600_reused_and_checked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/secrets-key");
        let k = SecretsKey::load_or_create(&p).unwrap();
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.len(), 32);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let s = k.seal("t", "i", 1, b"x").unwrap();
        let again = SecretsKey::load_or_create(&p).unwrap();
        assert_eq!(again.open("t", "i", 1, &s).as_deref(), Some(&b"x"[..]));
        for len in [0usize, 31, 33, 64] {
            let bad = dir.path().join(format!("bad{len}"));
            std::fs::write(&bad, vec![7u8; len]).unwrap();
            let e = SecretsKey::load_or_create(&bad).unwrap_err();
            assert!(
                matches!(e, SecretsKeyError::Size { len: l, .. } if l == len),
                "{e}"
            );
            assert!(e.to_string().contains("exactly 32"), "{e}");
        }
    }

    #[test]
    fn names_are_checked_and_canonical() {
        assert_eq!(check_name("OpenAI-Key").unwrap(), "openai-key");
        assert_eq!(check_name("a b.c/d:é").unwrap(), "a b.c/d:é");
        for n in [
            "", "a{b", "a}b", "a\nb", "a\0b", "a\u{7f}b", "a\u{85}b", "sec_x", "SEC_x",
        ] {
            assert!(check_name(n).is_err(), "{n:?}");
        }
        assert!(check_name(&"a".repeat(MAX_NAME)).is_ok());
        let e = check_name(&"a".repeat(MAX_NAME + 1)).unwrap_err();
        assert!(e.to_string().starts_with("name "), "{e}");
    }

    #[test]
    fn values_and_metadata_are_checked() {
        assert!(check_value("x").is_ok());
        assert!(check_value(&"x".repeat(MAX_VALUE)).is_ok());
        assert!(check_value("")
            .unwrap_err()
            .to_string()
            .starts_with("value"));
        assert!(check_value(&"x".repeat(MAX_VALUE + 1)).is_err());
        let m = |pairs: &[(&str, String)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect()
        };
        assert!(check_metadata(&m(&[("k", "v".into())])).is_ok());
        assert!(check_metadata(&BTreeMap::new()).is_ok());
        assert!(check_metadata(&m(&[("", "v".into())])).is_err());
        assert!(check_metadata(&m(&[("k", "v".repeat(MAX_META_VALUE + 1))])).is_err());
        let long_key = "k".repeat(MAX_META_KEY + 1);
        assert!(check_metadata(&m(&[(long_key.as_str(), "v".into())])).is_err());
        let many: BTreeMap<String, String> = (0..=MAX_META_ENTRIES)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert!(check_metadata(&many).is_err());
        let big: BTreeMap<String, String> = (0..10)
            .map(|i| (format!("k{i}"), "v".repeat(MAX_META_VALUE)))
            .collect();
        let e = check_metadata(&big).unwrap_err();
        assert!(e.to_string().starts_with("metadata"), "{e}");
    }

    #[test]
    fn ids_are_not_names() {
        let id = new_secret_id();
        assert!(id.starts_with(ID_PREFIX) && id.len() == 24, "{id}");
        assert!(check_name(&id).is_err());
    }
}
