//! The sampler (every `journal.sample_interval_ms`: each running sandbox's resource use, and
//! what its agent logged since the last pull) and the queries over the node's journal.

use super::{check_id, Node, NodeError};
use crate::journal::{AgentPage, LogQuery};
use crate::sandbox::{Phase, SandboxState};
use cube_proto::nodev1 as pb;
use std::sync::Arc;
use std::time::Duration;

/// How long one pull from an agent may take (a wedged agent must not hold up the sampler for
/// long; a guest whose kernel mode is emulated answers in well under this).
const PULL_TIMEOUT: Duration = Duration::from_secs(3);
/// The pull just before a kill.
pub(super) const LAST_PULL_TIMEOUT: Duration = Duration::from_millis(500);
/// Pages pulled at once (an agent keeps 1000 entries; a page is 500).
const PULL_PAGES: usize = 4;
/// Sandboxes sampled at once: an agent that does not answer holds up only its own slot, and a
/// pass is not a burst at every guest (on hosts where guest kernels are emulated, that costs).
const SAMPLE_CONCURRENCY: usize = 4;

impl Node {
    /// Starts the background sampler.
    pub fn spawn_sampler(self: &Arc<Self>) {
        let node = self.clone();
        let mut stop = self.host.shutdown.subscribe();
        tokio::spawn(async move {
            let every = Duration::from_millis(node.journal.config().sample_interval_ms.max(50));
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.changed() => break,
                }
                if *stop.borrow() {
                    break;
                }
                node.sample_all().await;
                node.journal.prune(crate::template::now_ms());
                let n = node.clone();
                // File writes off the runtime's threads.
                let _ = tokio::task::spawn_blocking(move || n.journal.flush()).await;
            }
            let n = node.clone();
            let _ = tokio::task::spawn_blocking(move || n.journal.flush()).await;
        });
    }

    /// One pass over the running sandboxes; one that is busy (being paused, snapshotted) is
    /// left for the next pass.
    pub async fn sample_all(&self) {
        use futures::StreamExt;
        let running: Vec<SandboxState> = self
            .entries()
            .into_iter()
            .filter_map(|e| match e.try_lock() {
                Ok(st) if st.phase == Phase::Running => Some(st.clone()),
                _ => None,
            })
            .collect();
        futures::stream::iter(running)
            .for_each_concurrent(SAMPLE_CONCURRENCY, |st| async move {
                self.record_sample(&st).await;
                self.pull_agent_log(&st, PULL_TIMEOUT).await;
            })
            .await;
    }

    async fn record_sample(&self, st: &SandboxState) {
        match self.runtime.sample(st).await {
            Ok(s) => self.journal.sample(&st.id, s),
            Err(e) => tracing::debug!(id = %st.id, error = %e, "sample"),
        }
    }

    /// What the agent logged since the last pull (best effort: a sandbox whose agent does not
    /// answer keeps what was pulled before).
    pub(super) async fn pull_agent_log(&self, st: &SandboxState, timeout: Duration) {
        let Some(ep) = &st.endpoint else { return };
        let client = self.host.agent(ep, st.host_addr);
        let token = self.journal.token(&st.id);
        let mut headers = vec![];
        if let Some(t) = &token {
            headers.push(("x-access-token", t.as_str()));
        }
        for _ in 0..PULL_PAGES {
            let after = self.journal.agent_next(&st.id);
            let path = format!("/logs?after={after}&limit=500");
            let page = match client
                .request("GET", &path, &headers, vec![], timeout)
                .await
            {
                Ok((200, body)) => match serde_json::from_slice::<AgentPage>(&body) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::debug!(id = %st.id, error = %e, "agent log: bad page");
                        return;
                    }
                },
                Ok((status, _)) => {
                    tracing::debug!(id = %st.id, status, "agent log: refused");
                    return;
                }
                Err(e) => {
                    tracing::debug!(id = %st.id, error = %e, "agent log: unreachable");
                    return;
                }
            };
            let full = page.entries.len() >= 500;
            self.journal.ingest(&st.id, page);
            if !full {
                return;
            }
        }
    }

    /// SandboxMetrics: the samples in the window; a running sandbox gets a fresh one first when
    /// the newest is older than a second (so a new sandbox has one at once).
    pub async fn metrics_history(
        &self,
        id: &str,
        start_ms: u64,
        end_ms: u64,
    ) -> Result<Vec<pb::SandboxStatsResponse>, NodeError> {
        check_id(id)?;
        if let Ok(st) = self.get(id).await {
            let newest = self.journal.newest_sample_ms(id);
            if st.phase == Phase::Running && crate::template::now_ms().saturating_sub(newest) > 1000
            {
                self.record_sample(&st).await;
            }
        } else if !self.journal.knows(id) {
            return Err(NodeError::NotFound(format!("sandbox {id} not found")));
        }
        Ok(self.journal.samples(id, start_ms, end_ms))
    }

    /// SandboxLogs: a running sandbox's agent is asked for what is new first.
    pub async fn logs(&self, r: &pb::SandboxLogsRequest) -> Result<Vec<pb::LogEntry>, NodeError> {
        check_id(&r.sandbox_id)?;
        let q = LogQuery::from_pb(r).map_err(NodeError::InvalidArgument)?;
        match self.get(&r.sandbox_id).await {
            Ok(st) if st.phase == Phase::Running => self.pull_agent_log(&st, PULL_TIMEOUT).await,
            Ok(_) => {}
            Err(_) if self.journal.knows(&r.sandbox_id) => {}
            Err(e) => return Err(e),
        }
        Ok(self.journal.logs(&r.sandbox_id, &q))
    }
}
