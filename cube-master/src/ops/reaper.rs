//! The TTL reaper: kills sandboxes at their `endAt`.

use super::Controller;
use std::sync::Arc;
use std::time::Duration;

impl Controller {
    /// Runs [`Controller::reap_once`] forever.
    pub async fn run_reaper(self: Arc<Self>, interval: Duration) {
        loop {
            match self.reap_once().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(killed = n, "reaper killed expired sandboxes"),
                Err(e) => tracing::warn!(error = %e, "reaper pass failed"),
            }
            tokio::time::sleep(interval).await;
        }
    }
}
