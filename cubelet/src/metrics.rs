//! Prometheus metrics served on the cubelet's HTTP port at `/metrics`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// All cubelet metrics.
pub struct Metrics {
    pub registry: Registry,
    /// `cube_pool_ready{pool, template}`: entries ready in a pool.
    pub pool_ready: IntGaugeVec,
    /// `cube_pool_target{pool, template}`: configured pool size.
    pub pool_target: IntGaugeVec,
    /// `cube_sandboxes{state}`.
    pub sandboxes: IntGaugeVec,
    /// `cube_sandbox_create_seconds{from_pool}`: request to agent healthy.
    pub create_seconds: HistogramVec,
    /// `cube_create_phase_seconds{phase}`: time spent in each phase of a create that did not
    /// come from the started pool: `disk`, `endpoint` (netns), `cgroup` (concurrent; `prepare`
    /// is their wall time), `launch` (with `veth` and `policy` concurrent), `healthy`, `init`,
    /// `total`; and of one that did (container runtimes): `pool_claim`, `pool_adopt`,
    /// `pool_init`.
    pub create_phase: HistogramVec,
    /// `cube_sandbox_operations_total{op, result}`.
    pub operations: IntCounterVec,
    /// `cube_sandbox_net_packets{sandbox, direction}`: packets through the switch port
    /// (direction `from_guest` or `to_guest`), read from cube-vs at scrape time.
    pub net_packets: IntGaugeVec,
    /// `cube_sandbox_net_bytes{sandbox, direction}`.
    pub net_bytes: IntGaugeVec,
    /// `cube_sandbox_net_drops{sandbox, direction}`: packets the switch dropped.
    pub net_drops: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let pool_ready = IntGaugeVec::new(
            Opts::new("cube_pool_ready", "Entries ready in a pool"),
            &["pool", "template"],
        )
        .expect("static metric");
        let pool_target = IntGaugeVec::new(
            Opts::new("cube_pool_target", "Configured size of a pool"),
            &["pool", "template"],
        )
        .expect("static metric");
        let sandboxes = IntGaugeVec::new(
            Opts::new("cube_sandboxes", "Sandboxes on this node by state"),
            &["state"],
        )
        .expect("static metric");
        let create_seconds = HistogramVec::new(
            HistogramOpts::new(
                "cube_sandbox_create_seconds",
                "CreateSandbox latency until the agent is ready",
            )
            .buckets(vec![
                0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
            ]),
            &["from_pool"],
        )
        .expect("static metric");
        let create_phase = HistogramVec::new(
            HistogramOpts::new(
                "cube_create_phase_seconds",
                "Time per phase of a CreateSandbox (pool_*: one taken from the started pool)",
            )
            .buckets(vec![
                0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 10.0,
            ]),
            &["phase"],
        )
        .expect("static metric");
        let operations = IntCounterVec::new(
            Opts::new(
                "cube_sandbox_operations_total",
                "Sandbox operations by result",
            ),
            &["op", "result"],
        )
        .expect("static metric");
        let net = |name: &str, help: &str| {
            IntGaugeVec::new(Opts::new(name, help), &["sandbox", "direction"])
                .expect("static metric")
        };
        let net_packets = net(
            "cube_sandbox_net_packets",
            "Packets through a sandbox's switch port",
        );
        let net_bytes = net(
            "cube_sandbox_net_bytes",
            "Bytes through a sandbox's switch port",
        );
        let net_drops = net(
            "cube_sandbox_net_drops",
            "Packets the switch dropped on a sandbox's port",
        );
        for c in [
            Box::new(pool_ready.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(pool_target.clone()),
            Box::new(sandboxes.clone()),
            Box::new(create_seconds.clone()),
            Box::new(create_phase.clone()),
            Box::new(operations.clone()),
            Box::new(net_packets.clone()),
            Box::new(net_bytes.clone()),
            Box::new(net_drops.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        Metrics {
            registry,
            pool_ready,
            pool_target,
            sandboxes,
            create_seconds,
            create_phase,
            operations,
            net_packets,
            net_bytes,
            net_drops,
        }
    }

    /// Text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
