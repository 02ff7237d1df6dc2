//! The edge's short-lived cache of master `GetSandbox` / `ResolveAccessToken` answers, so that
//! envd traffic (every SDK command and file call) does not cost a master round trip.
//!
//! Staleness is bounded two ways: entries live `ttl` (about a second), and the REST API drops a
//! sandbox's entries when it kills, pauses or connects it through this process. A generation
//! counter keeps a lookup that was in flight during an invalidation from re-inserting the old
//! answer.
//!
//! "No such sandbox" answers are kept too ([`NEGATIVE_TTL`]), so that a client repeating a bogus
//! id or token costs one master call, not one per request. They cannot hide a real sandbox: ids
//! and tokens are random and unknown before the master hands them out.

use cube_proto::master::v1::SandboxInfo;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Above this many entries, expired ones are swept; if still above, everything is dropped
/// (a cache miss only costs a master call).
const MAX_ENTRIES: usize = 50_000;
/// How long a "not found" answer is kept.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(5);

/// A cached master answer.
// Most entries are `Found`: boxing it would add an allocation per entry to save nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Found(SandboxInfo),
    Missing,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Key {
    Id(String),
    Token(String),
}

struct Inner {
    generation: u64,
    entries: HashMap<Key, (Instant, Answer)>,
}

pub struct SandboxCache {
    ttl: Duration,
    inner: Mutex<Inner>,
}

impl SandboxCache {
    /// A zero `ttl` disables the cache.
    pub fn new(ttl: Duration) -> SandboxCache {
        SandboxCache {
            ttl,
            inner: Mutex::new(Inner {
                generation: 0,
                entries: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means a panic elsewhere mid-insert; the map is still valid.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    /// A fresh answer, if any.
    pub fn get(&self, key: &Key) -> Option<Answer> {
        self.get_at(key, Instant::now())
    }

    pub fn get_at(&self, key: &Key, now: Instant) -> Option<Answer> {
        if !self.enabled() {
            return None;
        }
        let g = self.lock();
        match g.entries.get(key) {
            Some((at, a)) if now.saturating_duration_since(*at) < self.ttl_of(a) => Some(a.clone()),
            _ => None,
        }
    }

    /// The last answer that found `key` running, however old (until swept or invalidated):
    /// refreshing such an entry is not a guess, so no look-up limit applies to it, and while the
    /// master cannot be asked (a restart) the edge routes by it, since a running sandbox keeps
    /// its address.
    pub fn last_found(&self, key: &Key) -> Option<SandboxInfo> {
        if !self.enabled() {
            return None;
        }
        match self.lock().entries.get(key) {
            Some((_, Answer::Found(info))) => Some(info.clone()),
            _ => None,
        }
    }

    fn ttl_of(&self, a: &Answer) -> Duration {
        match a {
            Answer::Found(_) => self.ttl,
            Answer::Missing => NEGATIVE_TTL.max(self.ttl),
        }
    }

    /// The generation to pass to `insert` for a lookup starting now.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Stores a master answer obtained by a lookup that began at `generation`; ignored when an
    /// invalidation happened since, or when the sandbox is not running (those answers are
    /// refusals that must not outlive a resume).
    pub fn insert(&self, generation: u64, key: Key, info: SandboxInfo) {
        self.insert_at(generation, key, info, Instant::now())
    }

    pub fn insert_at(&self, generation: u64, key: Key, info: SandboxInfo, now: Instant) {
        if info.state != "running" {
            return;
        }
        self.put(generation, key, Answer::Found(info), now)
    }

    /// Records that the master knows no sandbox for `key`.
    pub fn insert_missing(&self, generation: u64, key: Key) {
        self.put(generation, key, Answer::Missing, Instant::now())
    }

    fn put(&self, generation: u64, key: Key, a: Answer, now: Instant) {
        if !self.enabled() {
            return;
        }
        let (ttl, neg) = (self.ttl, NEGATIVE_TTL.max(self.ttl));
        let mut g = self.lock();
        if g.generation != generation {
            return;
        }
        if g.entries.len() >= MAX_ENTRIES {
            g.entries.retain(|_, (at, a)| {
                let t = if matches!(a, Answer::Found(_)) {
                    ttl
                } else {
                    neg
                };
                now.saturating_duration_since(*at) < t
            });
            if g.entries.len() >= MAX_ENTRIES {
                g.entries.clear();
            }
        }
        g.entries.insert(key, (now, a));
    }

    /// Drops every entry of sandbox `id` (by id and by its access token). Returns how many.
    pub fn invalidate(&self, id: &str) -> usize {
        let mut g = self.lock();
        g.generation = g.generation.wrapping_add(1);
        let before = g.entries.len();
        g.entries.retain(|k, (_, a)| match a {
            Answer::Found(info) => info.sandbox_id != id,
            Answer::Missing => *k != Key::Id(id.to_string()),
        });
        before - g.entries.len()
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, state: &str) -> SandboxInfo {
        SandboxInfo {
            sandbox_id: id.into(),
            state: state.into(),
            access_token: format!("tok-{id}"),
            ..Default::default()
        }
    }

    #[test]
    fn ttl_expiry() {
        let c = SandboxCache::new(Duration::from_millis(1000));
        let t0 = Instant::now();
        let g = c.generation();
        c.insert_at(g, Key::Id("ia".into()), info("ia", "running"), t0);
        assert!(c
            .get_at(&Key::Id("ia".into()), t0 + Duration::from_millis(999))
            .is_some());
        assert!(c
            .get_at(&Key::Id("ia".into()), t0 + Duration::from_millis(1000))
            .is_none());
        let stale = c
            .last_found(&Key::Id("ia".into()))
            .expect("kept past its ttl");
        assert_eq!(stale.sandbox_id, "ia");
        assert_eq!(c.last_found(&Key::Id("ib".into())), None);
        c.invalidate("ia");
        assert_eq!(
            c.last_found(&Key::Id("ia".into())),
            None,
            "gone with a kill"
        );
        assert!(c.get_at(&Key::Id("ib".into()), t0).is_none());
    }

    #[test]
    fn invalidate_drops_id_and_token_and_blocks_inflight() {
        let c = SandboxCache::new(Duration::from_secs(5));
        let g = c.generation();
        c.insert(g, Key::Id("ia".into()), info("ia", "running"));
        c.insert(g, Key::Token("tok-ia".into()), info("ia", "running"));
        c.insert(g, Key::Id("ib".into()), info("ib", "running"));
        assert_eq!(c.invalidate("ia"), 2);
        assert!(c.get(&Key::Id("ia".into())).is_none());
        assert!(c.get(&Key::Token("tok-ia".into())).is_none());
        assert!(c.get(&Key::Id("ib".into())).is_some());
        // A lookup that started before the kill must not put the old answer back.
        c.insert(g, Key::Id("ia".into()), info("ia", "running"));
        assert!(c.get(&Key::Id("ia".into())).is_none());
        let g2 = c.generation();
        c.insert(g2, Key::Id("ia".into()), info("ia", "running"));
        assert!(c.get(&Key::Id("ia".into())).is_some());
    }

    #[test]
    fn only_running_and_disabled() {
        let c = SandboxCache::new(Duration::from_secs(5));
        c.insert(c.generation(), Key::Id("ip".into()), info("ip", "paused"));
        assert!(c.is_empty());
        let off = SandboxCache::new(Duration::ZERO);
        off.insert(
            off.generation(),
            Key::Id("ia".into()),
            info("ia", "running"),
        );
        assert!(off.get(&Key::Id("ia".into())).is_none() && off.is_empty());
    }

    #[test]
    fn missing_answers_are_kept_longer_and_dropped_by_invalidate() {
        let c = SandboxCache::new(Duration::from_millis(100));
        let k = Key::Id("inope".into());
        c.insert_missing(c.generation(), k.clone());
        assert_eq!(c.get(&k), Some(Answer::Missing));
        let later = Instant::now() + Duration::from_secs(1);
        assert_eq!(
            c.get_at(&k, later),
            Some(Answer::Missing),
            "kept past the positive ttl"
        );
        assert_eq!(
            c.get_at(&k, Instant::now() + NEGATIVE_TTL + Duration::from_millis(1)),
            None
        );
        assert_eq!(c.invalidate("inope"), 1);
        assert_eq!(c.get(&k), None);
        // An in-flight lookup from before the invalidation does not record it again.
        c.insert_missing(0, k.clone());
        assert_eq!(c.get(&k), None);
    }

    #[test]
    fn bounded() {
        let c = SandboxCache::new(Duration::from_secs(5));
        let t = Instant::now();
        for i in 0..MAX_ENTRIES + 10 {
            c.insert_at(
                0,
                Key::Id(format!("i{i}")),
                info(&format!("i{i}"), "running"),
                t,
            );
        }
        assert!(c.len() <= MAX_ENTRIES);
    }
}
