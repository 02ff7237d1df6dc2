//! cube-api daemon: REST API and sandbox edge.

use anyhow::Context;
use clap::Parser;
use cube_api::rest::{router, AppState};
use cube_api::{edge, master, ApiConfig};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "cube-api", about = "E2B-compatible REST API and sandbox edge")]
struct Cli {
    /// Config file (missing = defaults).
    #[arg(long, default_value = "/etc/cube/api.toml")]
    config: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let cfg = ApiConfig::load(&cli.config)?;
    let m = master::connect(&cfg.master_url)?;
    let api = tokio::net::TcpListener::bind(&cfg.api_addr)
        .await
        .with_context(|| format!("binding {}", cfg.api_addr))?;
    let edge_l = tokio::net::TcpListener::bind(&cfg.edge_addr)
        .await
        .with_context(|| format!("binding {}", cfg.edge_addr))?;
    tracing::info!(api = %cfg.api_addr, edge = %cfg.edge_addr, master = %cfg.master_url, "cube-api listening");
    let app = router(AppState {
        master: m.clone(),
        cfg: cfg.clone(),
    });
    let edge_task = tokio::spawn(edge::serve(edge_l, m));
    tokio::select! {
        r = axum::serve(api, app) => r.context("api server")?,
        r = edge_task => r.context("edge task")?.context("edge server")?,
        _ = shutdown() => tracing::info!("shutting down"),
    }
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
}
