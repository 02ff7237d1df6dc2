//! `sched-bench`: how long one placement decision of cube-master takes with N simulated nodes
//! (default 1,000; target ≤ 1 ms).
//!
//! Two measurements of the real code:
//! * `rank` — the pure scheduler function (`cube_master::fleet::scheduler::rank`) over node
//!   views;
//! * `place` — what a create does: `Nodes::place` (registry lock, views, rank, the best
//!   candidates copied out, in-flight accounting) over registered nodes fed by heartbeats.
//!
//! Nodes differ: 10 % not ready, 5 % cordoned, each holds 1–6 of 20 templates, random load
//! against a sandbox cap (some unlimited), random free memory, some with a warm pool.
//! Prints a markdown table and writes JSON to `--out DIR` (default
//! `benches/results/sched-bench-<unix time>/`). No root, no network.

use anyhow::Context;
use clap::Parser;
use cube_master::fleet::scheduler::{self, NodeView, Request};
use cube_master::fleet::{Beat, Nodes, Registration};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "cube-master scheduler decision time")]
struct Args {
    /// Output directory for results.json and results.md.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Simulated nodes.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Decisions measured per mode.
    #[arg(long, default_value_t = 5000)]
    iterations: usize,
    /// Random seed (the node population is reproducible).
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

struct SimNode {
    ready: bool,
    cordoned: bool,
    sandboxes: u32,
    max: u32,
    free_mib: u64,
    templates: Vec<String>,
    warm: Vec<String>,
}

fn population(n: usize, seed: u64) -> Vec<SimNode> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let k = r.gen_range(1..=6);
            let mut templates: Vec<String> = (0..k)
                .map(|_| format!("tpl-{}", r.gen_range(0..20)))
                .collect();
            // Most nodes hold the template the benchmark asks for.
            if r.gen_bool(0.8) {
                templates.push("base".into());
            }
            templates.sort();
            templates.dedup();
            let max = if r.gen_bool(0.2) {
                0
            } else {
                r.gen_range(50..500)
            };
            SimNode {
                ready: r.gen_bool(0.9),
                cordoned: r.gen_bool(0.05),
                sandboxes: r.gen_range(0..=max.max(100)),
                max,
                free_mib: r.gen_range(0..65536),
                warm: if r.gen_bool(0.3) {
                    vec!["base".into()]
                } else {
                    vec![]
                },
                templates,
            }
        })
        .collect()
}

struct Stats {
    p50: f64,
    p95: f64,
    p99: f64,
    max: f64,
    mean: f64,
}

fn stats(mut us: Vec<f64>) -> Stats {
    us.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| us[((us.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        p50: at(0.50),
        p95: at(0.95),
        p99: at(0.99),
        max: *us.last().unwrap_or(&0.0),
        mean: us.iter().sum::<f64>() / us.len().max(1) as f64,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(
        a.nodes > 0 && a.iterations > 0,
        "--nodes and --iterations must be > 0"
    );
    let pop = population(a.nodes, a.seed);
    let req = Request {
        template: "base",
        memory_mib: 512,
    };

    // 1. The pure function.
    let views: Vec<NodeView<'_>> = pop
        .iter()
        .map(|s| NodeView {
            ready: s.ready,
            cordoned: s.cordoned,
            sandboxes: s.sandboxes,
            recent: 0,
            max_sandboxes: s.max,
            free_memory_mib: s.free_mib,
            total_memory_mib: 65536,
            templates: &s.templates,
            warm_templates: &s.warm,
        })
        .collect();
    let eligible = scheduler::rank(&views, &req).map(|v| v.len()).unwrap_or(0);
    for _ in 0..100 {
        std::hint::black_box(scheduler::rank(&views, &req).ok());
    }
    let mut rank_us = Vec::with_capacity(a.iterations);
    for _ in 0..a.iterations {
        let t = Instant::now();
        let r = scheduler::rank(std::hint::black_box(&views), &req);
        rank_us.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(r.ok());
    }

    // 2. The create path's call into the node registry, over registered nodes.
    let nodes = Nodes::new(&[], 3)?;
    let now = cube_master::now_ms();
    for (i, s) in pop.iter().enumerate() {
        let id = format!("node-{i:04}");
        nodes
            .register(
                &Registration {
                    node_id: id.clone(),
                    address: format!(
                        "http://10.{}.{}.{}:9091",
                        i / 65536,
                        (i / 256) % 256,
                        i % 256
                    ),
                    max_sandboxes: s.max,
                    memory_mib: 65536,
                    vcpus: 32,
                    cordoned: s.cordoned,
                    ..Default::default()
                },
                now,
            )
            .context("registering a simulated node")?;
        nodes.heartbeat(
            &id,
            &Beat {
                sandboxes: s.sandboxes,
                templates: s.templates.clone(),
                disk_free_mib: 100_000,
                free_memory_mib: s.free_mib,
            },
            now,
        );
    }
    // Not-ready nodes: silent for longer than the heartbeat timeout.
    for (i, s) in pop.iter().enumerate() {
        if !s.ready {
            nodes.update(&format!("node-{i:04}"), |n| n.last_seen_ms = 0);
        }
    }
    nodes.expire(now);
    let mut place_us = Vec::with_capacity(a.iterations);
    for i in 0..a.iterations + 100 {
        let t = Instant::now();
        let r = nodes.place(req.template, req.memory_mib);
        let dt = t.elapsed().as_secs_f64() * 1e6;
        // The in-flight guard is dropped here, as when a create finishes.
        std::hint::black_box(r.is_ok());
        drop(r);
        if i >= 100 {
            place_us.push(dt);
        }
    }

    let rs = stats(rank_us);
    let ps = stats(place_us);
    let target_us = 1000.0;
    let mut md = format!(
        "## sched-bench: placement decision, {} nodes ({} eligible), {} decisions each\n\n\
         | measurement | p50 µs | p95 µs | p99 µs | max µs | mean µs | target |\n\
         |---|---|---|---|---|---|---|\n",
        a.nodes, eligible, a.iterations
    );
    for (name, s) in [("rank (pure scheduler)", &rs), ("place (create path)", &ps)] {
        md.push_str(&format!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | p95 ≤ {target_us:.0} µs: {} |\n",
            s.p50,
            s.p95,
            s.p99,
            s.max,
            s.mean,
            if s.p95 <= target_us { "met" } else { "MISSED" }
        ));
    }
    print!("{md}");
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let out = a
        .out
        .unwrap_or_else(|| PathBuf::from(format!("benches/results/sched-bench-{unix}")));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let j = |s: &Stats| serde_json::json!({"p50_us": s.p50, "p95_us": s.p95, "p99_us": s.p99, "max_us": s.max, "mean_us": s.mean});
    let json = serde_json::json!({
        "bench": "sched-bench",
        "unix_time": unix,
        "nodes": a.nodes,
        "eligible_nodes": eligible,
        "iterations": a.iterations,
        "seed": a.seed,
        "target_us": target_us,
        "rank": j(&rs),
        "place": j(&ps),
    });
    std::fs::write(out.join("results.json"), serde_json::to_vec_pretty(&json)?)?;
    std::fs::write(out.join("results.md"), &md)?;
    eprintln!("wrote {}", out.display());
    Ok(())
}
