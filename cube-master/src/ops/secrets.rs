//! E2B secrets (`/secrets`): the team's secrets, checked and sealed under the controller's
//! secrets key ([`crate::secrets`]) before they are stored ([`crate::store::secrets`]).

use super::Controller;
use crate::error::MasterError;
use crate::secrets::{check_metadata, check_name, check_value, new_secret_id, MAX_NAME};
use crate::store::encode_map;
use crate::store::secrets::SecretRow;
use std::collections::BTreeMap;

fn not_found(key: &str) -> MasterError {
    let shown: String = key.chars().take(64).collect();
    MasterError::NotFound(format!("secret {shown:?} not found"))
}

fn team_of(team: &str) -> Result<&str, MasterError> {
    if team.is_empty() {
        return Err(MasterError::InvalidArgument("team_id is required".into()));
    }
    Ok(team)
}

impl Controller {
    pub async fn create_secret(
        &self,
        team: &str,
        name: &str,
        value: &str,
        metadata: &BTreeMap<String, String>,
    ) -> Result<SecretRow, MasterError> {
        let team = team_of(team)?;
        let name = check_name(name)?;
        check_value(value)?;
        check_metadata(metadata)?;
        let id = new_secret_id();
        let now = crate::now_ms();
        let row = SecretRow {
            sealed: self.secrets.seal(team, &id, 1, value.as_bytes())?,
            id,
            team_id: team.to_string(),
            name,
            version: 1,
            metadata: encode_map(metadata),
            created_at_ms: now,
            updated_at_ms: now,
        };
        if !self.db.insert_secret(&row).await? {
            return Err(MasterError::AlreadyExists(format!(
                "a secret named {:?} already exists",
                row.name
            )));
        }
        Ok(row)
    }

    /// The team's secret named by id or name.
    pub async fn get_secret(&self, team: &str, key: &str) -> Result<SecretRow, MasterError> {
        let team = team_of(team)?;
        if key.is_empty() || key.len() > MAX_NAME {
            return Err(not_found(key));
        }
        self.db
            .get_secret(team, &key.to_lowercase())
            .await?
            .ok_or_else(|| not_found(key))
    }

    /// One page of the team's secrets, oldest first. The token is the last row's
    /// `<created_at_ms>.<id>`.
    pub async fn list_secrets(
        &self,
        team: &str,
        limit: u32,
        next_token: &str,
    ) -> Result<(Vec<SecretRow>, String), MasterError> {
        let team = team_of(team)?;
        let size = super::page::size(limit);
        let cursor = super::page::after(next_token)?;
        let rows = self.db.page_secrets(team, cursor, size + 1).await?;
        Ok(super::page::cut(rows, size, |s| {
            (s.created_at_ms, s.id.as_str())
        }))
    }

    /// Stores `value` as the secret's next version; `metadata` replaces the stored one when
    /// given.
    pub async fn update_secret(
        &self,
        team: &str,
        key: &str,
        value: &str,
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<SecretRow, MasterError> {
        check_value(value)?;
        if let Some(m) = metadata {
            check_metadata(m)?;
        }
        // Optimistic: the row moves only from the version the value was sealed for.
        for _ in 0..5 {
            let mut row = self.get_secret(team, key).await?;
            let from = row.version;
            row.version = from + 1;
            row.sealed = self
                .secrets
                .seal(&row.team_id, &row.id, row.version, value.as_bytes())?;
            if let Some(m) = metadata {
                row.metadata = encode_map(m);
            }
            row.updated_at_ms = crate::now_ms().max(row.created_at_ms);
            if self.db.update_secret(&row, from).await? {
                return Ok(row);
            }
        }
        Err(MasterError::Unavailable(
            "the secret changed concurrently; retry".into(),
        ))
    }

    pub async fn delete_secret(&self, team: &str, key: &str) -> Result<(), MasterError> {
        let row = self.get_secret(team, key).await?;
        if self.db.delete_secret(&row.team_id, &row.id).await? {
            Ok(())
        } else {
            Err(not_found(key))
        }
    }
}
