//! Per-API-key token buckets: one for sandbox creation (the expensive call) and one for every
//! other authenticated route, so that a client polling `GET /sandboxes/{id}` cannot starve its
//! own creates and a create storm cannot starve listing.

use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `[rate_limit]` in `cube-api.toml`. A rate of 0 disables that limit.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Sustained sandbox creates (and forks) per second per API key.
    pub create_per_s: f64,
    /// Creates allowed in a burst above the sustained rate.
    pub create_burst: u32,
    /// Sustained other requests per second per API key.
    pub other_per_s: f64,
    /// Other requests allowed in a burst.
    pub other_burst: u32,
    /// Sustained edge requests per second per client address that the edge's cache cannot
    /// answer (each costs a master look-up): bounds what a flood of bogus sandbox ids or
    /// tokens costs the master. Requests for sandboxes in the cache do not count.
    pub edge_lookup_per_s: f64,
    /// Such look-ups allowed in a burst.
    pub edge_lookup_burst: u32,
}

impl Default for RateLimitConfig {
    fn default() -> Self {
        // Generous: the limits exist to stop a runaway client, not to shape normal SDK use
        // (the create benchmark does > 100/s from one key).
        RateLimitConfig {
            create_per_s: 200.0,
            create_burst: 400,
            other_per_s: 2000.0,
            other_burst: 4000,
            // One client address may drive a thousand sandboxes whose cache entries expire
            // every second.
            edge_lookup_per_s: 1000.0,
            edge_lookup_burst: 2000,
        }
    }
}

impl RateLimitConfig {
    pub fn validate(&self) -> Result<(), String> {
        for (name, rate, burst) in [
            ("create", self.create_per_s, self.create_burst),
            ("other", self.other_per_s, self.other_burst),
            (
                "edge_lookup",
                self.edge_lookup_per_s,
                self.edge_lookup_burst,
            ),
        ] {
            if !rate.is_finite() || rate < 0.0 {
                return Err(format!(
                    "rate_limit.{name}_per_s must be a finite number >= 0"
                ));
            }
            if rate > 0.0 && burst == 0 {
                return Err(format!(
                    "rate_limit.{name}_burst must be >= 1 when {name}_per_s > 0"
                ));
            }
        }
        Ok(())
    }
}

/// Which bucket a request draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    Create,
    Other,
    /// An edge request that needs a master look-up (keyed by client address).
    EdgeLookup,
}

impl Class {
    /// Creates are `POST /sandboxes`, `POST /v2/sandboxes` and forks.
    pub fn of(method: &axum::http::Method, path: &str) -> Class {
        if method == axum::http::Method::POST
            && (path == "/sandboxes" || path == "/v2/sandboxes" || path.ends_with("/fork"))
        {
            Class::Create
        } else {
            Class::Other
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Buckets above this many keys trigger a sweep of the full (idle) ones, so the map stays
/// bounded by the number of recently active keys.
const SWEEP_AT: usize = 10_000;

pub struct RateLimiter {
    cfg: RateLimitConfig,
    buckets: Mutex<HashMap<(String, Class), Bucket>>,
}

impl RateLimiter {
    pub fn new(cfg: RateLimitConfig) -> RateLimiter {
        RateLimiter {
            cfg,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn params(&self, class: Class) -> (f64, f64) {
        match class {
            Class::Create => (self.cfg.create_per_s, f64::from(self.cfg.create_burst)),
            Class::Other => (self.cfg.other_per_s, f64::from(self.cfg.other_burst)),
            Class::EdgeLookup => (
                self.cfg.edge_lookup_per_s,
                f64::from(self.cfg.edge_lookup_burst),
            ),
        }
    }

    /// Takes one token for `key`; `Err(wait)` says how long until one is available.
    pub fn check(&self, key: &str, class: Class) -> Result<(), Duration> {
        self.check_at(key, class, Instant::now())
    }

    pub fn check_at(&self, key: &str, class: Class, now: Instant) -> Result<(), Duration> {
        let (rate, burst) = self.params(class);
        if rate <= 0.0 {
            return Ok(());
        }
        // A poisoned lock only means another request panicked mid-update of plain numbers.
        let mut map = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= SWEEP_AT {
            map.retain(|(_, c), b| {
                let (r, cap) = self.params(*c);
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * r < cap
            });
        }
        let b = map.entry((key.to_string(), class)).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * rate).min(burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / rate))
        }
    }
}

/// `Retry-After` is whole seconds; never 0, or clients retry immediately into the same wall.
pub fn retry_after_secs(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim(create: f64, cb: u32, other: f64, ob: u32) -> RateLimiter {
        RateLimiter::new(RateLimitConfig {
            create_per_s: create,
            create_burst: cb,
            other_per_s: other,
            other_burst: ob,
            ..Default::default()
        })
    }

    #[test]
    fn burst_then_refill() {
        let l = lim(2.0, 3, 0.0, 0);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(l.check_at("k", Class::Create, t0).is_ok());
        }
        let wait = l.check_at("k", Class::Create, t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        assert_eq!(retry_after_secs(wait), 1);
        // Half a second later exactly one token is back.
        let t1 = t0 + Duration::from_millis(500);
        assert!(l.check_at("k", Class::Create, t1).is_ok());
        assert!(l.check_at("k", Class::Create, t1).is_err());
        // Refill is capped at the burst.
        let t2 = t1 + Duration::from_secs(100);
        for _ in 0..3 {
            assert!(l.check_at("k", Class::Create, t2).is_ok());
        }
        assert!(l.check_at("k", Class::Create, t2).is_err());
    }

    #[test]
    fn keys_and_classes_are_independent() {
        let l = lim(1.0, 1, 1.0, 2);
        let t = Instant::now();
        assert!(l.check_at("a", Class::Create, t).is_ok());
        assert!(l.check_at("a", Class::Create, t).is_err());
        assert!(l.check_at("b", Class::Create, t).is_ok());
        assert!(l.check_at("a", Class::Other, t).is_ok());
        assert!(l.check_at("a", Class::Other, t).is_ok());
        assert!(l.check_at("a", Class::Other, t).is_err());
    }

    #[test]
    fn zero_rate_is_unlimited() {
        let l = lim(0.0, 0, 0.0, 0);
        let t = Instant::now();
        for _ in 0..10_000 {
            assert!(l.check_at("k", Class::Create, t).is_ok());
        }
    }

    #[test]
    fn sweep_bounds_memory() {
        let l = lim(1000.0, 1, 0.0, 0);
        let t = Instant::now();
        for i in 0..SWEEP_AT + 5 {
            let _ = l.check_at(&format!("k{i}"), Class::Create, t);
        }
        // Every bucket refills within 1 ms; a later check sweeps them all away.
        let _ = l.check_at("x", Class::Create, t + Duration::from_secs(1));
        assert!(l.buckets.lock().unwrap().len() < 10);
    }

    #[test]
    fn classes_and_validation() {
        use axum::http::Method;
        assert_eq!(Class::of(&Method::POST, "/sandboxes"), Class::Create);
        assert_eq!(Class::of(&Method::POST, "/v2/sandboxes"), Class::Create);
        assert_eq!(
            Class::of(&Method::POST, "/sandboxes/iab/fork"),
            Class::Create
        );
        assert_eq!(Class::of(&Method::GET, "/v2/sandboxes"), Class::Other);
        assert_eq!(
            Class::of(&Method::POST, "/sandboxes/iab/pause"),
            Class::Other
        );
        assert!(RateLimitConfig::default().validate().is_ok());
        let mut c = RateLimitConfig {
            create_per_s: -1.0,
            ..Default::default()
        };
        assert!(c.validate().is_err());
        c.create_per_s = f64::NAN;
        assert!(c.validate().is_err());
        c.create_per_s = 1.0;
        c.create_burst = 0;
        assert!(c.validate().is_err());
    }
}
