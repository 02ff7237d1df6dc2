//! envd access tokens. The database holds only their SHA-256 (`sha256:<hex>`): a copy of it does
//! not open any sandbox. The token itself is an HMAC of the sandbox id under the master's token
//! key (a file outside the database), so the master can hand it out again on connect and get.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::path::Path;

/// Prefix of a stored (hashed) token. Rows written before hashing hold the plain token.
pub const HASHED: &str = "sha256:";
/// First line of a key file; the version lets a later format replace it.
const KEY_HEADER: &str = "cube-master token key v1";

#[derive(Debug, thiserror::Error)]
pub enum TokenKeyError {
    #[error("token key {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("token key {path}: {reason}")]
    Format { path: String, reason: &'static str },
}

/// The master's secret for deriving tokens.
#[derive(Clone)]
pub struct TokenKey([u8; 32]);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    /// A key for this process only (tests; tokens stop matching after a restart).
    pub fn random() -> TokenKey {
        use rand::RngCore;
        let mut k = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut k);
        TokenKey(k)
    }

    /// Reads the key file, creating it (mode 0600) when absent. Several masters of one fleet
    /// must share the file.
    pub fn load_or_create(path: &Path) -> Result<TokenKey, TokenKeyError> {
        let p = path.display().to_string();
        let io = |source| TokenKeyError::Io {
            path: p.clone(),
            source,
        };
        let bad = |reason| TokenKeyError::Format {
            path: p.clone(),
            reason,
        };
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let mut lines = text.lines();
                if lines.next() != Some(KEY_HEADER) {
                    return Err(bad("not a cube-master token key (bad header)"));
                }
                let line = lines.next().ok_or_else(|| bad("no key line"))?;
                let (hexkey, sum) = line.split_once(' ').ok_or_else(|| bad("no checksum"))?;
                let raw = hex::decode(hexkey).map_err(|_| bad("key is not hex"))?;
                let k: [u8; 32] = raw.try_into().map_err(|_| bad("key is not 32 bytes"))?;
                if hex::encode(&Sha256::digest(k)[..4]) != sum {
                    return Err(bad("checksum mismatch (damaged file)"));
                }
                Ok(TokenKey(k))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let k = TokenKey::random();
                if let Some(d) = path.parent() {
                    std::fs::create_dir_all(d).map_err(io)?;
                }
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(io)?;
                let sum = hex::encode(&Sha256::digest(k.0)[..4]);
                writeln!(f, "{KEY_HEADER}\n{} {sum}", hex::encode(k.0)).map_err(io)?;
                f.sync_all().map_err(io)?;
                Ok(k)
            }
            Err(e) => Err(io(e)),
        }
    }

    /// The envd access token of a sandbox.
    pub fn token(&self, sandbox_id: &str) -> String {
        // new_from_slice accepts any key length; 32 bytes cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        m.update(b"envd-access-token\0");
        m.update(sandbox_id.as_bytes());
        hex::encode(&m.finalize().into_bytes()[..24])
    }

    /// The token as the row stores it: `HASHED` rows are derived, others are legacy plain.
    pub fn reveal(&self, sandbox_id: &str, stored: &str) -> String {
        if stored.starts_with(HASHED) {
            self.token(sandbox_id)
        } else {
            stored.to_string()
        }
    }
}

/// What the database stores for `token`.
pub fn stored(token: &str) -> String {
    format!("{HASHED}{}", hex::encode(Sha256::digest(token.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_per_key_and_sandbox_and_stored_hashed() {
        let (a, b) = (TokenKey::random(), TokenKey::random());
        assert_eq!(a.token("i1"), a.token("i1"));
        assert_ne!(a.token("i1"), a.token("i2"));
        assert_ne!(a.token("i1"), b.token("i1"));
        assert_eq!(a.token("i1").len(), 48);
        let s = stored(&a.token("i1"));
        assert!(s.starts_with(HASHED) && !s.contains(&a.token("i1")), "{s}");
        assert_eq!(a.reveal("i1", &s), a.token("i1"));
        assert_eq!(a.reveal("i1", "legacy-plain"), "legacy-plain");
    }

    #[test]
    fn key_file_round_trips_and_rejects_damage() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/token.key");
        let k = TokenKey::load_or_create(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(
            TokenKey::load_or_create(&p).unwrap().token("x"),
            k.token("x")
        );
        let text = std::fs::read_to_string(&p).unwrap();
        let flipped = if text.as_bytes()[KEY_HEADER.len() + 1] == b'0' {
            '1'
        } else {
            '0'
        };
        let mut damaged = text.clone().into_bytes();
        damaged[KEY_HEADER.len() + 1] = flipped as u8;
        std::fs::write(&p, damaged).unwrap();
        let e = TokenKey::load_or_create(&p).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        std::fs::write(&p, "hello\n").unwrap();
        assert!(TokenKey::load_or_create(&p).is_err());
    }
}
