//! Which cube-master leads. Several masters may share one PostgreSQL database: the one holding a
//! session-level advisory lock leads (serves gRPC, runs the reaper and the node checks); the
//! others stand by, not listening, and try the lock every `standby_poll_ms`. PostgreSQL decides:
//! the lock goes when the leader's session ends (the process dies: its connection closes), and a
//! leader whose host stops answering loses its session after `LEASE_IDLE` (the server's
//! `idle_session_timeout`, which the leader's ping keeps from firing while it lives). A leader
//! whose ping fails stops at once, so that two never serve together for longer than one ping.
//!
//! On SQLite (one master per database file) the master always leads.

use crate::error::MasterError;
use crate::store::Backend;
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection};
use std::time::Duration;

/// How often the leader checks that its session (and so its lock) is still there.
const PING: Duration = Duration::from_secs(1);
/// How long the server keeps the session of a leader that stopped pinging (a frozen or
/// unreachable host) before ending it, which hands the lock on.
const LEASE_IDLE: &str = "5s";

/// The advisory lock's key: one per database and schema, so that test stacks sharing a
/// database in their own schemas do not contend.
fn lock_key(database: &str, schema: &str) -> i64 {
    let d = Sha256::digest(format!("cube-master-leader/{database}/{schema}"));
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    i64::from_be_bytes(b)
}

/// The leading master's hold on its database.
pub enum Lease {
    /// SQLite: nobody else can lead.
    Sole,
    /// PostgreSQL: the session holding the advisory lock.
    Pg(PgConnection),
}

impl Lease {
    /// Waits until this master leads. On PostgreSQL: connects (again and again while the
    /// database is away) and tries the lock every `poll`.
    pub async fn acquire(url: &str, poll: Duration) -> Result<Lease, MasterError> {
        if Backend::of_url(url)? != Backend::Postgres {
            return Ok(Lease::Sole);
        }
        let mut logged = false;
        loop {
            match Self::try_pg(url).await {
                Ok(Some(c)) => return Ok(Lease::Pg(c)),
                Ok(None) => {
                    if !logged {
                        tracing::info!("another cube-master leads: standing by");
                        logged = true;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "standby: trying the leader lock failed"),
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// One try: `Some(session)` holding the lock, `None` when another session holds it.
    async fn try_pg(url: &str) -> Result<Option<PgConnection>, MasterError> {
        let mut c = PgConnection::connect(url).await?;
        let (db, schema): (String, String) =
            sqlx::query_as("SELECT current_database(), current_schema()")
                .fetch_one(&mut c)
                .await?;
        let key = lock_key(&db, &schema);
        let (got,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut c)
            .await?;
        if !got {
            let _ = c.close().await;
            return Ok(None);
        }
        // Operators (and tests) find the leader's session in pg_stat_activity by this name.
        let name: String = format!("cube-master leader {schema}")
            .chars()
            .take(63)
            .collect();
        sqlx::query("SELECT set_config('application_name', $1, false)")
            .bind(name)
            .execute(&mut c)
            .await?;
        // PostgreSQL 14 and later; on older ones only a closed connection hands the lock on.
        if let Err(e) = sqlx::query(&format!("SET idle_session_timeout = '{LEASE_IDLE}'"))
            .execute(&mut c)
            .await
        {
            tracing::warn!(error = %e, "idle_session_timeout not set: a frozen leader keeps the lock until its connection drops");
        }
        Ok(Some(c))
    }

    /// Resolves when the lease is gone (its session failed a ping): the master must stop.
    /// Never resolves for [`Lease::Sole`].
    pub async fn lost(self) -> MasterError {
        let Lease::Pg(mut c) = self else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(PING).await;
            if let Err(e) = c.ping().await {
                return MasterError::Db(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::lock_key;

    #[test]
    fn lock_keys_differ_by_schema_and_database() {
        assert_eq!(lock_key("cube", "public"), lock_key("cube", "public"));
        assert_ne!(lock_key("cube", "public"), lock_key("cube", "t_1"));
        assert_ne!(lock_key("cube", "public"), lock_key("other", "public"));
    }
}
