//! Typed errors of the master, mapped to gRPC status codes at the service boundary.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum MasterError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("node {node}: {}", status.message())]
    Node {
        node: String,
        status: Box<tonic::Status>,
    },
    #[error("{0}")]
    Internal(String),
}

impl From<MasterError> for tonic::Status {
    fn from(e: MasterError) -> Self {
        use tonic::Code;
        if e.is_transient_db() {
            // The caller may retry: the database is restarting or another writer holds it.
            return tonic::Status::unavailable(format!(
                "{e} (the master's database is unavailable for now; retry)"
            ));
        }
        let msg = e.to_string();
        match e {
            MasterError::InvalidArgument(_) => tonic::Status::invalid_argument(msg),
            MasterError::NotFound(_) => tonic::Status::not_found(msg),
            MasterError::AlreadyExists(_) => tonic::Status::already_exists(msg),
            MasterError::FailedPrecondition(_) => tonic::Status::failed_precondition(msg),
            MasterError::Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            MasterError::ResourceExhausted(_) => tonic::Status::resource_exhausted(msg),
            MasterError::Unavailable(_) => tonic::Status::unavailable(msg),
            // A node's own verdict on the request (bad template, ...) is passed through.
            MasterError::Node { status, .. } => match status.code() {
                Code::InvalidArgument | Code::NotFound | Code::ResourceExhausted => {
                    tonic::Status::new(status.code(), msg)
                }
                _ => tonic::Status::internal(msg),
            },
            MasterError::Db(_) | MasterError::Migrate(_) | MasterError::Internal(_) => {
                tonic::Status::internal(msg)
            }
        }
    }
}

impl MasterError {
    /// A database error that goes away by itself: the database is restarting or unreachable
    /// (PostgreSQL), or another writer holds it longer than the busy wait (SQLite). A request
    /// failing so is answered `Unavailable`, which clients retry, rather than `Internal`.
    pub fn is_transient_db(&self) -> bool {
        let MasterError::Db(e) = self else {
            return false;
        };
        match e {
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(d) => {
                let sqlite = d.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some();
                d.code().is_some_and(|c| transient_code(sqlite, &c))
            }
            // The Any driver reports a connection closed under it (PostgreSQL shut down) so.
            sqlx::Error::Protocol(m) => m.contains("closed") || m.contains("terminat"),
            _ => false,
        }
    }
}

/// SQLite's BUSY and LOCKED (with their extended codes); PostgreSQL's connection exceptions
/// (class 08), shutdown and start-up (57P01-57P03), too many connections, and the conflicts a
/// retry resolves (serialization failure, deadlock).
fn transient_code(sqlite: bool, code: &str) -> bool {
    if sqlite {
        return code.parse::<i64>().is_ok_and(|n| matches!(n & 0xff, 5 | 6));
    }
    code.starts_with("08")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "53300" | "40001" | "40P01"
        )
}

#[cfg(test)]
mod tests {
    use super::{transient_code, MasterError};

    #[test]
    fn transient_database_codes() {
        // SQLITE_BUSY, SQLITE_LOCKED, SQLITE_BUSY_SNAPSHOT (517).
        for c in ["5", "6", "517"] {
            assert!(transient_code(true, c), "{c}");
        }
        for c in ["08006", "57P01", "57P03", "40P01", "40001"] {
            assert!(transient_code(false, c), "{c}");
        }
        // SQLITE_CONSTRAINT_UNIQUE (2067), SQLITE_CONSTRAINT; unique_violation, undefined_table.
        for c in ["2067", "19"] {
            assert!(!transient_code(true, c), "{c}");
        }
        for c in ["23505", "42P01", "5"] {
            assert!(!transient_code(false, c), "{c}");
        }
        let busy = tonic::Status::from(MasterError::Db(sqlx::Error::PoolTimedOut));
        assert_eq!(busy.code(), tonic::Code::Unavailable);
        assert!(busy.message().contains("retry"), "{}", busy.message());
        let other = tonic::Status::from(MasterError::Db(sqlx::Error::RowNotFound));
        assert_eq!(other.code(), tonic::Code::Internal);
    }
}
