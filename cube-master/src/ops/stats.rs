//! A sandbox's current resource use, read from its node (cgroup and disk on the namespace
//! runtime): one fresh sample (the node's history of samples is [`super::history`]).

use super::Controller;
use crate::error::MasterError;
use crate::state::SandboxState;
use cube_proto::nodev1 as node;
use std::time::Duration;

impl Controller {
    pub async fn sandbox_stats(
        &self,
        team: &str,
        id: &str,
    ) -> Result<node::SandboxStatsResponse, MasterError> {
        let row = self.get(team, id).await?;
        if row.state != SandboxState::Running {
            // A paused sandbox uses no CPU and its memory is on disk: E2B answers with no samples.
            return Err(MasterError::FailedPrecondition(format!(
                "Sandbox \"{id}\" is {}",
                row.state
            )));
        }
        let n = self.node_of(&row)?;
        let mut c = n.client.clone();
        match tokio::time::timeout(
            Duration::from_secs(5),
            c.sandbox_stats(node::SandboxRef {
                sandbox_id: id.to_string(),
            }),
        )
        .await
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(MasterError::Node {
                node: n.address,
                status: Box::new(s),
            }),
            Err(_) => Err(MasterError::Unavailable(format!(
                "stats of {id} timed out on node {}",
                n.address
            ))),
        }
    }
}
