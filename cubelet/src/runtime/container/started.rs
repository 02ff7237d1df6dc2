//! The started pool: sandboxes pre-started per template, warm and waiting for their `/init`,
//! and the accounting that lets a create wait for one that is nearly ready rather than start
//! another from scratch.

use crate::network::Network;
use crate::runtime::host::{Host, PoolLevel};
use crate::runtime::process::is_alive;
use crate::sandbox::SandboxState;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The directory (and state id) of a pool entry.
pub fn dirname(key: &str) -> String {
    format!("pool-{key}")
}

#[derive(Default)]
pub struct StartedPool {
    /// template → pre-started sandboxes (phase Pooled).
    ready: Mutex<HashMap<String, Vec<SandboxState>>>,
    /// template → (pre-starts under way, creates waiting for one of them).
    starting: Mutex<HashMap<String, (usize, usize)>>,
    /// Signalled whenever a pre-start ends (pooled or failed).
    done: tokio::sync::Notify,
}

/// An entry can be handed out while it is of the current build, its process lives, and its
/// network endpoint is whole (see `Network::intact`).
fn usable(p: &SandboxState, build: &str) -> bool {
    p.build == build
        && is_alive(p.pid, p.pid_start)
        && p.endpoint.as_ref().is_none_or(Network::intact)
}

impl StartedPool {
    /// A pre-started sandbox: one from the pool, else the next one of the pre-starts under
    /// way (most of its work is done, and starting another from scratch would compete with
    /// them for the CPU), else None when none is coming.
    pub async fn claim(&self, h: &Host, template: &str, build: &str) -> Option<SandboxState> {
        if let Some(p) = self.take(h, template, build) {
            return Some(p);
        }
        // Wait only while there are more pre-starts under way than creates already waiting
        // for them: with more creates than that, a cold start is sooner than the queue.
        let reserved = self
            .starting
            .lock()
            .map(|mut m| {
                let (coming, waiting) = m.entry(template.to_string()).or_default();
                if *coming > *waiting {
                    *waiting += 1;
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        if !reserved {
            return None;
        }
        let deadline = Instant::now() + Duration::from_millis(h.cfg.pools.claim_wait_ms);
        let got = loop {
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if let Some(p) = self.take(h, template, build) {
                break Some(p);
            }
            let coming = self
                .starting
                .lock()
                .map(|m| m.get(template).map(|c| c.0).unwrap_or(0))
                .unwrap_or(0);
            if coming == 0
                || tokio::time::timeout_at(deadline.into(), done)
                    .await
                    .is_err()
            {
                break None;
            }
        };
        if let Ok(mut m) = self.starting.lock() {
            if let Some(c) = m.get_mut(template) {
                c.1 = c.1.saturating_sub(1);
            }
        }
        got
    }

    fn take(&self, h: &Host, template: &str, build: &str) -> Option<SandboxState> {
        let mut s = self.ready.lock().ok()?;
        let v = s.get_mut(template)?;
        let i = v.iter().rposition(|p| usable(p, build))?;
        let p = v.remove(i);
        h.defer_refill();
        Some(p)
    }

    /// Removes and returns a template's entries that can no longer be handed out (an older
    /// build, or dead).
    pub fn stale(&self, template: &str, build: &str) -> Vec<SandboxState> {
        self.ready
            .lock()
            .map(|mut s| {
                let v = s.entry(template.to_string()).or_default();
                let (keep, stale): (Vec<_>, Vec<_>) = v.drain(..).partition(|p| usable(p, build));
                *v = keep;
                stale
            })
            .unwrap_or_default()
    }

    /// Pre-starts a template's sandboxes with `prestart` until the pool holds `target`, a few
    /// at a time; each lands in the pool as soon as it is ready (a create may be waiting).
    pub async fn refill<F, Fut>(&self, h: &Host, template: &str, target: usize, prestart: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<SandboxState, crate::error::NodeError>>,
    {
        let par = match h.cfg.pools.refill_parallelism {
            0 => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(4),
            n => n as usize,
        };
        loop {
            let have = self
                .ready
                .lock()
                .map(|s| s.get(template).map(|v| v.len()).unwrap_or(0))
                .unwrap_or(usize::MAX);
            let want = target.saturating_sub(have).min(par);
            // A create may take an entry while this pass runs: its hold counts here too.
            if want == 0 || h.shutting_down() || h.refill_hold_left().is_some() {
                break;
            }
            if let Ok(mut m) = self.starting.lock() {
                m.entry(template.to_string()).or_default().0 += want;
            }
            let batch = futures::future::join_all((0..want).map(|_| async {
                let ok = match prestart().await {
                    Ok(p) => {
                        if let Ok(mut s) = self.ready.lock() {
                            s.entry(template.to_string()).or_default().push(p)
                        }
                        true
                    }
                    Err(e) => {
                        tracing::warn!(template, error = %e, "started pool refill");
                        false
                    }
                };
                if let Ok(mut m) = self.starting.lock() {
                    if let Some(c) = m.get_mut(template) {
                        c.0 = c.0.saturating_sub(1);
                    }
                }
                self.done.notify_waiters();
                ok
            }))
            .await;
            if batch.iter().any(|ok| !ok) {
                break;
            }
        }
    }

    /// Levels for the templates with a configured target.
    pub fn levels(&self, targets: &BTreeMap<String, u32>) -> Vec<PoolLevel> {
        targets
            .iter()
            .map(|(t, n)| PoolLevel {
                pool: "started".into(),
                template: t.clone(),
                ready: self
                    .ready
                    .lock()
                    .map(|s| s.get(t).map(|x| x.len() as u32).unwrap_or(0))
                    .unwrap_or(0),
                target: *n,
            })
            .collect()
    }

    /// Removes and returns the entries of one template, or all.
    pub fn drain(&self, template: Option<&str>) -> Vec<SandboxState> {
        self.ready
            .lock()
            .map(|mut s| match template {
                Some(t) => s.remove(t).unwrap_or_default(),
                None => s.drain().flat_map(|(_, v)| v).collect(),
            })
            .unwrap_or_default()
    }
}
