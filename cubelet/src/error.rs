//! The error of node operations: one kind per gRPC status code. Runtimes return it too, so
//! that each failure keeps its kind (a wrong state is a failed precondition, not internal).

use crate::template::TemplateError;

/// Errors of node operations; each maps to one gRPC status code.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
}

impl From<TemplateError> for NodeError {
    fn from(e: TemplateError) -> Self {
        match e {
            TemplateError::BadName(_) | TemplateError::BadBuild(_) | TemplateError::Source(_) => {
                NodeError::InvalidArgument(e.to_string())
            }
            TemplateError::NotFound(_) | TemplateError::NoBuild { .. } => {
                NodeError::NotFound(e.to_string())
            }
            TemplateError::InUse(..) => NodeError::FailedPrecondition(e.to_string()),
            _ => NodeError::Internal(e.to_string()),
        }
    }
}

/// `map_err` for string errors: an internal error with context.
pub fn internal(ctx: &str) -> impl FnOnce(String) -> NodeError + '_ {
    move |e| NodeError::Internal(format!("{ctx}: {e}"))
}

/// An internal error from a failed blocking task.
pub fn task(e: tokio::task::JoinError) -> NodeError {
    NodeError::Internal(format!("task: {e}"))
}
