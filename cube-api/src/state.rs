//! What every handler shares: the master client, the config, the edge's cache, metrics, the
//! rate limiter and the made-up idempotency keys.

use crate::master::Master;
use crate::metrics::Metrics;
use crate::ratelimit::RateLimiter;
use crate::sandbox_cache::SandboxCache;
use crate::ApiConfig;
use std::sync::Arc;

#[derive(Clone)]
pub struct AppState {
    pub master: Master,
    pub cfg: ApiConfig,
    /// The edge's sandbox cache: kill/pause/connect here invalidate it.
    pub cache: Arc<SandboxCache>,
    pub metrics: Arc<Metrics>,
    pub limiter: Arc<RateLimiter>,
    /// Idempotency keys for creates that come without one.
    pub retry_keys: Arc<RetryKeys>,
}

/// Makes up an idempotency key for each create that has none, so that the master client's
/// resend of that create (across a master restart, see `master.rs`) answers with the sandbox of
/// the first try instead of making a second. Unique per process run (a random prefix) and per
/// create (a counter).
pub struct RetryKeys {
    prefix: String,
    next: std::sync::atomic::AtomicU64,
}

impl RetryKeys {
    pub fn new() -> RetryKeys {
        let mut seed = [0u8; 12];
        if let Err(e) = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed))
        {
            // Still unique per run unless two runs share a nanosecond and a pid.
            tracing::warn!(error = %e, "no /dev/urandom; retry keys seeded from the clock");
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            seed[..8].copy_from_slice(&(t as u64).to_le_bytes());
            seed[8..].copy_from_slice(&std::process::id().to_le_bytes());
        }
        RetryKeys {
            prefix: format!(
                "{}{}-",
                cube_proto::RETRY_IDEMPOTENCY_PREFIX,
                hex::encode(seed)
            ),
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub fn next(&self) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}{n}", self.prefix)
    }
}

impl Default for RetryKeys {
    fn default() -> Self {
        RetryKeys::new()
    }
}

impl AppState {
    /// State with a fresh cache, metrics and limiter built from `cfg`.
    pub fn new(master: Master, cfg: ApiConfig) -> AppState {
        AppState {
            master,
            cache: Arc::new(SandboxCache::new(std::time::Duration::from_millis(
                cfg.edge_cache_ttl_ms,
            ))),
            metrics: Arc::new(Metrics::new()),
            limiter: Arc::new(RateLimiter::new(cfg.rate_limit.clone())),
            retry_keys: Arc::new(RetryKeys::new()),
            cfg,
        }
    }

    /// Makes the edge ask the master again about `id` (after a kill, pause or resume).
    pub(crate) fn invalidate(&self, id: &str) {
        if self.cache.invalidate(id) > 0 {
            self.metrics.edge_invalidations.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_up_idempotency_keys_differ_per_create_and_per_run() {
        let (a, b) = (RetryKeys::new(), RetryKeys::new());
        let (a1, a2, b1) = (a.next(), a.next(), b.next());
        assert_ne!(a1, a2);
        assert_ne!(a1, b1, "two runs of cube-api must not share keys");
        for k in [&a1, &a2, &b1] {
            assert!(k.starts_with(cube_proto::RETRY_IDEMPOTENCY_PREFIX), "{k}");
            // What the master accepts as a key.
            assert!(
                k.len() <= 255 && k.bytes().all(|b| b.is_ascii_graphic()),
                "{k}"
            );
        }
    }
}
