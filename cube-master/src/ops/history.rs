//! A sandbox's metrics history and log, kept by its node (`journal` in cubelet): asked of the
//! node it ran on last, also after it ended (within that node's retention).

use super::Controller;
use crate::error::MasterError;
use crate::fleet::Node;
use cube_proto::nodev1 as node;
use std::time::Duration;

/// The node's answer must come quickly: these are reads of its memory.
const NODE_TIMEOUT: Duration = Duration::from_secs(5);

async fn ask<T>(
    n: &Node,
    what: &str,
    id: &str,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, MasterError> {
    match tokio::time::timeout(NODE_TIMEOUT, fut).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) if s.code() == tonic::Code::NotFound => Err(MasterError::NotFound(format!(
            "the {what} of sandbox \"{id}\" are no longer kept"
        ))),
        Ok(Err(s)) => Err(MasterError::Node {
            node: n.address.clone(),
            status: Box::new(s),
        }),
        Err(_) => Err(MasterError::Unavailable(format!(
            "the {what} of {id} timed out on node {}",
            n.address
        ))),
    }
}

impl Controller {
    /// The node a sandbox of this team ran on last, whatever its state now.
    async fn last_node_of(&self, team: &str, id: &str) -> Result<Node, MasterError> {
        let row = self.any_state(team, id).await?;
        self.node_of(&row)
    }

    pub async fn sandbox_metrics_history(
        &self,
        team: &str,
        q: node::SandboxMetricsRequest,
    ) -> Result<node::SandboxMetricsResponse, MasterError> {
        let n = self.last_node_of(team, &q.sandbox_id).await?;
        let id = q.sandbox_id.clone();
        let mut c = n.client.clone();
        ask(&n, "metrics", &id, c.sandbox_metrics(q)).await
    }

    pub async fn sandbox_logs(
        &self,
        team: &str,
        q: node::SandboxLogsRequest,
    ) -> Result<node::SandboxLogsResponse, MasterError> {
        let n = self.last_node_of(team, &q.sandbox_id).await?;
        let id = q.sandbox_id.clone();
        let mut c = n.client.clone();
        ask(&n, "logs", &id, c.sandbox_logs(q)).await
    }
}
