//! Shims spawned ahead of time: each holds a VM shell of one shape with one template's memory
//! already mapped (`cube-shim --template`), so that a create only sends `restore` (state load,
//! well under a millisecond) instead of paying for process start, KVM VM creation and memslot
//! registration (6–22 ms on this kind of host).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::microvm::SpawnedShim;

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
