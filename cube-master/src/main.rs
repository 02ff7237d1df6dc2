//! cube-master daemon.

use anyhow::Context;
use clap::{Parser, Subcommand};
use cube_master::db::Db;
use cube_master::nodes::Nodes;
use cube_master::server::MasterService;
use cube_master::service::Controller;
use cube_master::{reaper, MasterConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "cube-master", about = "Cube scheduler and source of truth")]
struct Cli {
    /// Config file (missing = defaults).
    #[arg(long, default_value = "/etc/cube/master.toml")]
    config: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the daemon.
    Run,
    /// Prints the effective configuration's defaults as TOML-like text.
    DefaultConfig,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::DefaultConfig => {
            println!("{:#?}", MasterConfig::default());
            Ok(())
        }
        Cmd::Run => {
            let cfg = MasterConfig::load(&cli.config)?;
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(run(cfg))
        }
    }
}

async fn run(cfg: MasterConfig) -> anyhow::Result<()> {
    let db = Db::open(&cfg.database_url)
        .await
        .with_context(|| format!("opening {}", cfg.database_url))?;
    let nodes = Nodes::new(&cfg.nodes, cfg.node_max_misses)?;
    nodes.poll_once().await;
    tokio::spawn(
        nodes
            .clone()
            .run_poller(Duration::from_millis(cfg.node_poll_interval_ms)),
    );
    let addr = cfg.grpc_addr.parse().context("grpc_addr")?;
    let reap = Duration::from_millis(cfg.reaper_interval_ms);
    let ctl = Arc::new(Controller::new(cfg, db, nodes));
    tokio::spawn(reaper::run(ctl.clone(), reap));
    tracing::info!(%addr, "cube-master listening");
    tonic::transport::Server::builder()
        .add_service(MasterService::new(ctl))
        .serve_with_shutdown(addr, shutdown())
        .await?;
    Ok(())
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}
