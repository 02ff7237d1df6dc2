//! API keys: `e2b_<40 hex>`, stored only as their SHA-256.

use crate::error::MasterError;
use crate::store::apikeys::ApiKeyRow;
use crate::store::Db;
use rand::RngCore;
use sha2::{Digest, Sha256};

pub const DEFAULT_TEAM: &str = "default";

/// Hex SHA-256 of a key, as stored.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Whether `key` has the `e2b_<hex>` shape (checked before any database lookup).
pub fn well_formed(key: &str) -> bool {
    key.strip_prefix("e2b_").is_some_and(|h| {
        !h.is_empty() && h.len() <= 128 && h.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::thread_rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// Creates a key; returns the row and the secret (shown once).
pub async fn create(db: &Db, name: &str, team: &str) -> Result<(ApiKeyRow, String), MasterError> {
    if name.len() > 200 {
        return Err(MasterError::InvalidArgument(
            "key name too long (max 200)".into(),
        ));
    }
    let secret = format!("e2b_{}", random_hex(20));
    let row = ApiKeyRow {
        id: format!("k{}", random_hex(6)),
        name: name.to_string(),
        team_id: if team.is_empty() {
            DEFAULT_TEAM.into()
        } else {
            team.into()
        },
        key_sha256: hash_key(&secret),
        prefix: secret[..12].to_string(),
        created_at_ms: crate::now_ms(),
        revoked: 0,
    };
    db.insert_api_key(&row).await?;
    Ok((row, secret))
}

/// Returns the key's row, or Unauthenticated.
pub async fn validate(db: &Db, key: &str) -> Result<ApiKeyRow, MasterError> {
    if !well_formed(key) {
        return Err(MasterError::Unauthenticated(
            "Invalid API key format".into(),
        ));
    }
    db.api_key_by_hash(&hash_key(key))
        .await?
        .ok_or_else(|| MasterError::Unauthenticated("Invalid API key".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape() {
        assert!(well_formed("e2b_00ff"));
        assert!(!well_formed("e2b_"));
        assert!(!well_formed("e2b_xyz"));
        assert!(!well_formed("abc"));
        assert_eq!(hash_key("a").len(), 64);
    }
}
