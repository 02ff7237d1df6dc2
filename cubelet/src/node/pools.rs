//! The background refiller (failure checks, then each runtime's pools), pool levels and the
//! gauges that report them.

use super::{Entry, Node};
use crate::runtime::host::PoolLevel;
use crate::sandbox::Phase;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

impl Node {
    /// Starts the background pool refiller.
    pub fn spawn_refiller(self: &Arc<Self>) {
        let node = self.clone();
        let mut stop = self.host.shutdown.subscribe();
        let h = tokio::spawn(async move {
            let interval = Duration::from_millis(node.host.cfg.pools.refill_interval_ms.max(10));
            loop {
                node.refill_once().await;
                let wait = node
                    .host
                    .refill_hold_left()
                    .map_or(interval, |held| held.min(interval));
                tokio::select! {
                    _ = node.host.wake.notified() => {}
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.changed() => break,
                }
                if *stop.borrow() {
                    break;
                }
            }
        });
        *self.refiller.lock().unwrap_or_else(|p| p.into_inner()) = Some(h);
    }

    /// One pass: failed sandboxes recorded, overdue ones ended, then every pool filled up to
    /// its target.
    pub async fn refill_once(&self) {
        if self.host.shutting_down() {
            return;
        }
        self.check_failures();
        self.end_overdue().await;
        if self.host.refill_hold_left().is_none() {
            self.runtime.refill().await;
        }
        self.update_gauges();
    }

    /// Sandboxes whose runtime process died become `Failed` (reported, kept until killed).
    fn check_failures(&self) {
        for e in self.entries() {
            let Ok(mut st) = e.try_lock() else { continue };
            if !matches!(st.phase, Phase::Running | Phase::Paused) {
                continue;
            }
            let Some(why) = self.runtime.failure(&mut st) else {
                continue;
            };
            tracing::error!(id = %st.id, pid = st.pid, reason = %why, runtime = st.runtime.name(), "sandbox failed");
            st.phase = Phase::Failed;
            let id = st.id.clone();
            if let Err(e) = self.host.save(&id, &st) {
                tracing::error!(id, error = %e, "recording failure");
            }
            self.host
                .metrics
                .operations
                .with_label_values(&["sandbox_died", "error"])
                .inc();
        }
    }

    /// Every pool: the shared ones, then the runtime's.
    pub fn pool_levels(&self) -> Vec<PoolLevel> {
        let mut v = self.host.pool_levels();
        v.extend(self.runtime.pool_levels());
        v
    }

    pub(super) fn entries(&self) -> Vec<Entry> {
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub(super) fn update_gauges(&self) {
        let mut counts: HashMap<&'static str, i64> = HashMap::new();
        for e in self.entries() {
            let ph = e.try_lock().map(|s| s.phase).unwrap_or(Phase::Creating);
            *counts.entry(ph.label()).or_default() += 1;
        }
        let m = &self.host.metrics;
        for (ph, label) in Phase::ALL {
            if ph != Phase::Pooled {
                m.sandboxes
                    .with_label_values(&[label])
                    .set(*counts.get(label).unwrap_or(&0));
            }
        }
        for l in self.pool_levels() {
            let k = [l.pool.as_str(), l.template.as_str()];
            m.pool_ready.with_label_values(&k).set(i64::from(l.ready));
            m.pool_target.with_label_values(&k).set(i64::from(l.target));
        }
    }
}
