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
