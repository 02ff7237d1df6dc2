//! After a restart: re-adopt the sandboxes that still run, reap half-created ones and every
//! resource no valid state refers to.

use super::{Entry, Node};
use crate::sandbox::{Phase, SandboxState};
use std::path::PathBuf;
use std::sync::Arc;

impl Node {
    pub(super) async fn recover(&self) {
        let h = &self.host;
        let dirs: Vec<PathBuf> = std::fs::read_dir(&h.sandboxes_dir)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let mut live: Vec<SandboxState> = Vec::new();
        for dir in dirs {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            match crate::sandbox::load(&dir.join("state.json")) {
                Ok(st) if self.readoptable(&st, &name) => {
                    tracing::info!(id = %st.id, pid = st.pid, phase = ?st.phase, runtime = st.runtime.name(), "re-adopted sandbox");
                    live.push(st.clone());
                    // The journal kept its book (and the agent's token) on disk.
                    self.journal.begin(&st.id, st.created_at_ms, None);
                    self.journal.event(
                        &st.id,
                        "info",
                        "Sandbox re-adopted by a restarted node",
                        &[],
                    );
                    let e: Entry = Arc::new(tokio::sync::Mutex::new(st));
                    self.registry
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(name, e);
                }
                Ok(st) => {
                    tracing::warn!(id = %st.id, phase = ?st.phase, runtime = st.runtime.name(), "reaping sandbox that was not running at restart");
                    self.destroy(&name, &st).await;
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "reaping sandbox directory without valid state");
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        // Orphans: resources no valid state refers to (a crash between creating and recording).
        for key in h.cg.list() {
            if !live.iter().any(|s| s.key == key) {
                tracing::warn!(key, "reaping orphan cgroup");
                if let Err(e) = h.cg.destroy(&key) {
                    tracing::error!(key, error = %e, "orphan cgroup");
                }
            }
        }
        // Only endpoints whose namespace file lives in our run directory are ours: other
        // cubelets (tests, a second instance) may own other `cvh*` links on this host.
        for k in h.net.list_netns() {
            if !live
                .iter()
                .any(|s| s.endpoint.as_ref().is_some_and(|ep| ep.key == k))
            {
                h.net.destroy_key(&k).await;
            }
        }
        if let Ok(rd) = std::fs::read_dir(&h.pool_disk_dir) {
            for e in rd.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        self.runtime.reap_leftovers(&live);
        let ids: std::collections::HashSet<String> = live.iter().map(|s| s.id.clone()).collect();
        self.journal.end_missing(&ids, crate::template::now_ms());
        self.update_gauges();
    }

    /// Whether a sandbox found at restart is taken back: it was running or paused, on this
    /// node's runtime, its host process is the one it started (or, paused to disk, it has
    /// none), and the runtime agrees.
    fn readoptable(&self, st: &SandboxState, dirname: &str) -> bool {
        if !matches!(st.phase, Phase::Running | Phase::Paused) || st.id != dirname {
            return false;
        }
        if st.runtime.name() != self.runtime.name() {
            tracing::warn!(id = %st.id, was = st.runtime.name(), now = self.runtime.name(), "sandbox of another runtime");
            return false;
        }
        let on_disk =
            st.phase == Phase::Paused && (st.stopped || st.runtime.paused_image().is_some());
        (on_disk || crate::runtime::is_alive(st.pid, st.pid_start)) && self.runtime.readopt(st)
    }
}
