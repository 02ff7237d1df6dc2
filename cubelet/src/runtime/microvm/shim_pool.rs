//! Shims spawned ahead of time: each holds a VM shell of one shape with one template's memory
//! already mapped (`cube-shim --template`), so that a create only sends `restore` (state load,
//! well under a millisecond) instead of paying for process start, KVM VM creation and memslot
//! registration (6–22 ms on this kind of host).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::shim::SpawnedShim;

/// What a pooled shim fits: the snapshot it is prepared for and its shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub snapshot: PathBuf,
    pub vcpus: u32,
    pub mem_mib: u64,
}

#[derive(Default)]
pub struct ShimPool {
    ready: Mutex<HashMap<PoolKey, Vec<SpawnedShim>>>,
}

impl ShimPool {
    /// Takes a live shim for `key` (dead ones found on the way are returned for cleanup).
    pub fn take(&self, key: &PoolKey) -> (Option<SpawnedShim>, Vec<SpawnedShim>) {
        let mut dead = Vec::new();
        let Ok(mut m) = self.ready.lock() else {
            return (None, dead);
        };
        let Some(v) = m.get_mut(key) else {
            return (None, dead);
        };
        while let Some(mut s) = v.pop() {
            if matches!(s.child.try_wait(), Ok(None)) {
                return (Some(s), dead);
            }
            dead.push(s);
        }
        (None, dead)
    }

    pub fn put(&self, key: PoolKey, shim: SpawnedShim) {
        if let Ok(mut m) = self.ready.lock() {
            m.entry(key).or_default().push(shim);
        }
    }

    pub fn level(&self, key: &PoolKey) -> usize {
        self.ready
            .lock()
            .map(|m| m.get(key).map(Vec::len).unwrap_or(0))
            .unwrap_or(0)
    }

    /// Levels per template snapshot directory (for metrics and NodeStatus).
    pub fn levels(&self) -> Vec<(PoolKey, usize)> {
        self.ready
            .lock()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.len())).collect())
            .unwrap_or_default()
    }

    /// Removes and returns the shims whose snapshot lies under `dir` (a template being
    /// deleted), or all of them with `None`.
    pub fn drain(&self, under: Option<&Path>) -> Vec<SpawnedShim> {
        let Ok(mut m) = self.ready.lock() else {
            return Vec::new();
        };
        let keys: Vec<PoolKey> = m
            .keys()
            .filter(|k| under.map(|d| k.snapshot.starts_with(d)).unwrap_or(true))
            .cloned()
            .collect();
        keys.into_iter()
            .flat_map(|k| m.remove(&k).unwrap_or_default())
            .collect()
    }
}

/// Exponential back-off per key (a template) for refill steps that keep failing (a template
/// snapshot that cannot be built, shims that do not start): the refiller runs every
/// `pools.refill_interval_ms` and on every create, and would otherwise retry at that rate,
/// burning CPU and flooding the log. The first retry waits `first`, each further failure
/// doubles the wait up to `max`, and a success forgets the key.
pub struct Backoff {
    first: Duration,
    max: Duration,
    /// key → (current wait, not before).
    failing: Mutex<HashMap<String, (Duration, Instant)>>,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max: max.max(first),
            failing: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `key` may be tried at `now`.
    pub fn ready(&self, key: &str, now: Instant) -> bool {
        self.failing
            .lock()
            .map(|m| m.get(key).map(|(_, at)| now >= *at).unwrap_or(true))
            .unwrap_or(true)
    }

    /// Records a failure at `now`; returns how long `key` now waits.
    pub fn failed(&self, key: &str, now: Instant) -> Duration {
        let Ok(mut m) = self.failing.lock() else {
            return self.first;
        };
        let wait = match m.get(key) {
            Some((w, _)) => w.saturating_mul(2).min(self.max),
            None => self.first,
        };
        m.insert(key.to_string(), (wait, now + wait));
        wait
    }

    /// Records a success: the next failure starts from `first` again.
    pub fn succeeded(&self, key: &str) {
        if let Ok(mut m) = self.failing.lock() {
            m.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_100ms_to_5s_and_resets_on_success() {
        let b = Backoff::default();
        let t0 = Instant::now();
        assert!(b.ready("t", t0), "an untried key is ready");
        let waits: Vec<u128> = (0..9).map(|_| b.failed("t", t0).as_millis()).collect();
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000],
            "doubling, capped at 5 s"
        );
        // Not before the current wait has passed, then ready again.
        assert!(!b.ready("t", t0 + Duration::from_millis(4999)));
        assert!(b.ready("t", t0 + Duration::from_millis(5000)));
        // Keys are independent.
        assert!(b.ready("other", t0));
        // A success starts the schedule over.
        b.succeeded("t");
        assert!(b.ready("t", t0));
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.failed("t", t1), Duration::from_millis(100));
        assert!(!b.ready("t", t1 + Duration::from_millis(99)));
        assert!(b.ready("t", t1 + Duration::from_millis(100)));
    }

    #[test]
    fn backoff_max_below_first_is_first() {
        let b = Backoff::new(Duration::from_millis(300), Duration::from_millis(10));
        let t0 = Instant::now();
        assert_eq!(b.failed("k", t0), Duration::from_millis(300));
        assert_eq!(b.failed("k", t0), Duration::from_millis(300));
    }
}
