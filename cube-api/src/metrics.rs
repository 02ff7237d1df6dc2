//! Prometheus metrics of the REST API and the edge, served at `/metrics` on `metrics_addr`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    /// `cube_api_requests_total{method, route, status}`; `route` is the router's pattern
    /// (`/sandboxes/:id`), never the raw path, so ids do not explode the label set.
    pub requests: IntCounterVec,
    /// `cube_api_request_seconds{method, route}`.
    pub latency: HistogramVec,
    /// `cube_api_rate_limited_total{class}`.
    pub rate_limited: IntCounterVec,
    /// `cube_edge_requests_total{result}`: `proxied`, `not_found`, `port_closed`, `forbidden`,
    /// `unauthorized`, `bad_request`, `rate_limited`, `master_unavailable`.
    pub edge_requests: IntCounterVec,
    /// `cube_edge_bytes_total{direction}`: body bytes `to_sandbox` / `from_sandbox`.
    pub edge_bytes: IntCounterVec,
    /// `cube_edge_lookup_total{source}`: sandbox lookups served by the `cache`, the
    /// `master`, or (master unreachable) the last answer it gave, `stale`.
    pub edge_lookups: IntCounterVec,
    /// `cube_edge_cache_invalidations_total`.
    pub edge_invalidations: IntCounter,
    /// `cube_edge_auto_resumes_total`: paused sandboxes resumed by a request (autoResume).
    pub edge_auto_resumes: IntCounter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("cube_api_requests_total", "REST API requests"),
            &["method", "route", "status"],
        )
        .expect("static metric");
        let latency = HistogramVec::new(
            HistogramOpts::new("cube_api_request_seconds", "REST API request latency").buckets(
                vec![
                    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
                ],
            ),
            &["method", "route"],
        )
        .expect("static metric");
        let rate_limited = IntCounterVec::new(
            Opts::new(
                "cube_api_rate_limited_total",
                "Requests refused with 429 by the per-key rate limit",
            ),
            &["class"],
        )
        .expect("static metric");
        let edge_requests = IntCounterVec::new(
            Opts::new("cube_edge_requests_total", "Edge requests by outcome"),
            &["result"],
        )
        .expect("static metric");
        let edge_bytes = IntCounterVec::new(
            Opts::new("cube_edge_bytes_total", "Body bytes proxied by the edge"),
            &["direction"],
        )
        .expect("static metric");
        let edge_lookups = IntCounterVec::new(
            Opts::new(
                "cube_edge_lookup_total",
                "Edge sandbox lookups by where the answer came from",
            ),
            &["source"],
        )
        .expect("static metric");
        let edge_invalidations = IntCounter::new(
            "cube_edge_cache_invalidations_total",
            "Edge cache entries dropped by kill/pause/connect through the API",
        )
        .expect("static metric");
        let edge_auto_resumes = IntCounter::new(
            "cube_edge_auto_resumes_total",
            "Paused sandboxes resumed by a request through the edge (autoResume)",
        )
        .expect("static metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(latency.clone()),
            Box::new(rate_limited.clone()),
            Box::new(edge_requests.clone()),
            Box::new(edge_bytes.clone()),
            Box::new(edge_lookups.clone()),
            Box::new(edge_invalidations.clone()),
            Box::new(edge_auto_resumes.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        Metrics {
            registry,
            requests,
            latency,
            rate_limited,
            edge_requests,
            edge_bytes,
            edge_lookups,
            edge_invalidations,
            edge_auto_resumes,
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for well-formed metric families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// Serves `GET /metrics` (and `/health`) until the listener fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: std::sync::Arc<Metrics>,
) -> std::io::Result<()> {
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4",
                        )],
                        m.render(),
                    )
                }
            }),
        )
        .route("/health", get(|| async { axum::http::StatusCode::OK }));
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family() {
        let m = Metrics::new();
        m.requests
            .with_label_values(&["GET", "/v2/sandboxes", "200"])
            .inc();
        m.latency
            .with_label_values(&["GET", "/v2/sandboxes"])
            .observe(0.003);
        m.rate_limited.with_label_values(&["create"]).inc();
        m.edge_requests.with_label_values(&["proxied"]).inc();
        m.edge_bytes.with_label_values(&["from_sandbox"]).inc_by(42);
        m.edge_lookups.with_label_values(&["cache"]).inc();
        m.edge_invalidations.inc();
        let t = m.render();
        for want in [
            "cube_api_requests_total{method=\"GET\",route=\"/v2/sandboxes\",status=\"200\"} 1",
            "cube_api_request_seconds_bucket{method=\"GET\",route=\"/v2/sandboxes\",le=\"0.005\"} 1",
            "cube_api_rate_limited_total{class=\"create\"} 1",
            "cube_edge_requests_total{result=\"proxied\"} 1",
            "cube_edge_bytes_total{direction=\"from_sandbox\"} 42",
            "cube_edge_lookup_total{source=\"cache\"} 1",
            "cube_edge_cache_invalidations_total 1",
        ] {
            assert!(t.contains(want), "missing {want} in\n{t}");
        }
    }
}
