//! The TTL reaper: kills sandboxes at their `endAt`.

use crate::service::Controller;
use std::sync::Arc;
use std::time::Duration;

pub async fn run(ctl: Arc<Controller>, interval: Duration) {
    loop {
        match ctl.reap_once().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(killed = n, "reaper killed expired sandboxes"),
            Err(e) => tracing::warn!(error = %e, "reaper pass failed"),
        }
        tokio::time::sleep(interval).await;
    }
}
