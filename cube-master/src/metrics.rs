//! Prometheus metrics of the master, served as text at `http://<metrics_addr>/metrics`
//! ([`crate::ops::Controller::metrics_text`]; the endpoint is the daemon's).
//!
//! Names (stable; dashboards use them):
//! - `cube_master_sandboxes{state}` — sandboxes per state (read from the database at scrape)
//! - `cube_master_sandbox_create_seconds` — histogram of successful creates, request to running
//! - `cube_master_sandbox_creates_total{result}` — `ok` | `error`
//! - `cube_master_scheduler_decisions_total{result}` — `placed` | `no_ready_node` |
//!   `no_template` | `no_capacity`
//! - `cube_master_scheduler_decision_seconds` — histogram of one placement decision
//! - `cube_master_create_failovers_total` — creates retried on another node
//! - `cube_master_nodes{status}` — `ready` | `not_ready` | `unknown`; `cube_master_nodes_cordoned`
//! - `cube_master_sandboxes_lost_total` — sandboxes marked lost because their node went away
//! - `cube_master_sandboxes_auto_paused_total` — sandboxes paused at their timeout (autoPause)
//! - `cube_master_orphans_killed_total` — sandboxes killed on a node because no row (or only a
//!   finished one) claims them
//! - `cube_master_sandboxes_gone_total` — rows ended because their node no longer runs them
//! - `cube_master_idempotent_replays_total` — creates answered with an earlier create's sandbox
//! - `cube_master_grpc_requests_total{method}`, `cube_master_grpc_errors_total{method, code}`

use crate::fleet::{Health, Nodes};
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

pub struct Metrics {
    pub registry: Registry,
    pub sandboxes: IntGaugeVec,
    pub create_seconds: Histogram,
    pub creates: IntCounterVec,
    pub decisions: IntCounterVec,
    pub decision_seconds: Histogram,
    pub failovers: IntCounter,
    pub nodes: IntGaugeVec,
    pub nodes_cordoned: IntGauge,
    pub lost: IntCounter,
    pub auto_paused: IntCounter,
    pub orphans_killed: IntCounter,
    pub gone: IntCounter,
    pub idempotent_replays: IntCounter,
    pub grpc_requests: IntCounterVec,
    pub grpc_errors: IntCounterVec,
    pub leader: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        // Construction of fixed, valid metric definitions cannot fail; a failure here is a
        // programming error caught by the unit test below.
        fn must<T>(r: prometheus::Result<T>) -> T {
            r.expect("metric definition")
        }
        let registry = Registry::new();
        let sandboxes = must(IntGaugeVec::new(
            Opts::new("cube_master_sandboxes", "Sandboxes per state"),
            &["state"],
        ));
        let create_seconds = must(Histogram::with_opts(
            HistogramOpts::new(
                "cube_master_sandbox_create_seconds",
                "Successful sandbox creates, request to running",
            )
            .buckets(vec![
                0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
            ]),
        ));
        let creates = must(IntCounterVec::new(
            Opts::new(
                "cube_master_sandbox_creates_total",
                "Sandbox creates by result",
            ),
            &["result"],
        ));
        let decisions = must(IntCounterVec::new(
            Opts::new(
                "cube_master_scheduler_decisions_total",
                "Placement decisions by result",
            ),
            &["result"],
        ));
        let decision_seconds = must(Histogram::with_opts(
            HistogramOpts::new(
                "cube_master_scheduler_decision_seconds",
                "Time of one placement decision",
            )
            .buckets(vec![
                1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2,
            ]),
        ));
        let failovers = must(IntCounter::new(
            "cube_master_create_failovers_total",
            "Creates retried on another node after a node failed them",
        ));
        let nodes = must(IntGaugeVec::new(
            Opts::new("cube_master_nodes", "Nodes by status"),
            &["status"],
        ));
        let nodes_cordoned = must(IntGauge::new(
            "cube_master_nodes_cordoned",
            "Cordoned nodes",
        ));
        let lost = must(IntCounter::new(
            "cube_master_sandboxes_lost_total",
            "Sandboxes marked lost because their node stopped answering",
        ));
        let auto_paused = must(IntCounter::new(
            "cube_master_sandboxes_auto_paused_total",
            "Sandboxes paused, not killed, at their timeout (autoPause)",
        ));
        let orphans_killed = must(IntCounter::new(
            "cube_master_orphans_killed_total",
            "Sandboxes killed on a node because no row (or only a finished one) claims them",
        ));
        let gone = must(IntCounter::new(
            "cube_master_sandboxes_gone_total",
            "Rows of running or paused sandboxes ended because their node no longer runs them",
        ));
        let idempotent_replays = must(IntCounter::new(
            "cube_master_idempotent_replays_total",
            "Creates answered with the sandbox of an earlier create with the same Idempotency-Key",
        ));
        let grpc_requests = must(IntCounterVec::new(
            Opts::new("cube_master_grpc_requests_total", "gRPC requests by method"),
            &["method"],
        ));
        let grpc_errors = must(IntCounterVec::new(
            Opts::new(
                "cube_master_grpc_errors_total",
                "gRPC requests answered with an error, by method and status code",
            ),
            &["method", "code"],
        ));
        let leader = must(IntGauge::new(
            "cube_master_leader",
            "1 while this master leads, 0 while it stands by (another leads on its database)",
        ));
        for c in [
            Box::new(leader.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(sandboxes.clone()),
            Box::new(create_seconds.clone()),
            Box::new(creates.clone()),
            Box::new(decisions.clone()),
            Box::new(decision_seconds.clone()),
            Box::new(failovers.clone()),
            Box::new(nodes.clone()),
            Box::new(nodes_cordoned.clone()),
            Box::new(lost.clone()),
            Box::new(auto_paused.clone()),
            Box::new(orphans_killed.clone()),
            Box::new(gone.clone()),
            Box::new(idempotent_replays.clone()),
            Box::new(grpc_requests.clone()),
            Box::new(grpc_errors.clone()),
        ] {
            must(registry.register(c));
        }
        Metrics {
            registry,
            sandboxes,
            create_seconds,
            creates,
            decisions,
            decision_seconds,
            failovers,
            nodes,
            nodes_cordoned,
            lost,
            auto_paused,
            orphans_killed,
            gone,
            idempotent_replays,
            grpc_requests,
            grpc_errors,
            leader,
        }
    }

    /// Refreshes the gauges read at scrape time.
    pub fn observe_nodes(&self, nodes: &Nodes) {
        let (mut ready, mut not_ready, mut unknown, mut cordoned) = (0, 0, 0, 0);
        for n in nodes.snapshot() {
            match n.health {
                Health::Ready => ready += 1,
                Health::NotReady => not_ready += 1,
                Health::Unknown => unknown += 1,
            }
            if n.cordoned {
                cordoned += 1;
            }
        }
        self.nodes.with_label_values(&["ready"]).set(ready);
        self.nodes.with_label_values(&["not_ready"]).set(not_ready);
        self.nodes.with_label_values(&["unknown"]).set(unknown);
        self.nodes_cordoned.set(cordoned);
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            return format!("# encoding metrics failed: {e}\n");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// A tower layer counting gRPC requests and errors per method. Errors returned by handlers
/// travel as "trailers-only" responses, so their `grpc-status` is in the response headers.
#[derive(Clone)]
pub struct GrpcLayer(pub Arc<Metrics>);

impl<S> tower::Layer<S> for GrpcLayer {
    type Service = GrpcService<S>;
    fn layer(&self, inner: S) -> GrpcService<S> {
        GrpcService {
            inner,
            metrics: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcService<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

/// `grpc-status` numbers to the names used in the `code` label.
pub fn code_name(code: &str) -> &'static str {
    match code {
        "0" => "OK",
        "1" => "CANCELLED",
        "2" => "UNKNOWN",
        "3" => "INVALID_ARGUMENT",
        "4" => "DEADLINE_EXCEEDED",
        "5" => "NOT_FOUND",
        "6" => "ALREADY_EXISTS",
        "7" => "PERMISSION_DENIED",
        "8" => "RESOURCE_EXHAUSTED",
        "9" => "FAILED_PRECONDITION",
        "10" => "ABORTED",
        "11" => "OUT_OF_RANGE",
        "12" => "UNIMPLEMENTED",
        "13" => "INTERNAL",
        "14" => "UNAVAILABLE",
        "15" => "DATA_LOSS",
        "16" => "UNAUTHENTICATED",
        _ => "OTHER",
    }
}

impl<S, B, RB> tower::Service<http::Request<B>> for GrpcService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // `/cube.master.v1.Master/CreateSandbox` → `CreateSandbox`; unknown paths share one label.
        let path = req.uri().path();
        let method = match path.strip_prefix("/cube.master.v1.Master/") {
            Some(m) if !m.is_empty() && m.len() <= 64 && !m.contains('/') => m.to_string(),
            _ => "other".to_string(),
        };
        let fut = self.inner.call(req);
        let m = self.metrics.clone();
        Box::pin(async move {
            let r = fut.await;
            m.grpc_requests.with_label_values(&[&method]).inc();
            if let Ok(resp) = &r {
                if let Some(code) = resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                {
                    if code != "0" {
                        m.grpc_errors
                            .with_label_values(&[&method, code_name(code)])
                            .inc();
                    }
                }
            }
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_register_and_render() {
        let m = Metrics::new();
        m.creates.with_label_values(&["ok"]).inc();
        m.grpc_errors
            .with_label_values(&["GetSandbox", code_name("5")])
            .inc();
        let t = m.render();
        assert!(
            t.contains("cube_master_sandbox_creates_total{result=\"ok\"} 1"),
            "{t}"
        );
        assert!(
            t.contains("cube_master_grpc_errors_total{code=\"NOT_FOUND\",method=\"GetSandbox\"} 1"),
            "{t}"
        );
    }
}
