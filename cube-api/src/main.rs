//! cube-api daemon: REST API and sandbox edge.

use anyhow::Context;
use clap::Parser;
use cube_api::handlers::router;
use cube_api::state::AppState;
use cube_api::{edge, master, metrics, ApiConfig};
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
    let cli = Cli::parse();
    let cfg = ApiConfig::load(&cli.config)?;
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr);
    match cfg.log_format {
        cube_proto::logging::LogFormat::Json => fmt.json().init(),
        cube_proto::logging::LogFormat::Text => fmt.init(),
    }
    // The master links over mutual TLS when `[tls]` is set (an http:// URL is upgraded).
    let channels = cfg
        .masters()
        .iter()
        .map(|u| cube_proto::tls::connect_lazy(u, cfg.tls.as_ref()).context("master_url"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let m = master::client(
        channels.clone(),
        std::time::Duration::from_millis(cfg.master_retry_ms),
    );
    let api = tokio::net::TcpListener::bind(&cfg.api_addr)
        .await
        .with_context(|| format!("binding {}", cfg.api_addr))?;
    let edge_l = tokio::net::TcpListener::bind(&cfg.edge_addr)
        .await
        .with_context(|| format!("binding {}", cfg.edge_addr))?;
    tracing::info!(api = %cfg.api_addr, edge = %cfg.edge_addr, masters = ?cfg.masters(), "cube-api listening");
    let state = AppState::new(m.clone(), cfg.clone());
    let metrics_task = if cfg.metrics_addr.is_empty() {
        tokio::spawn(std::future::pending::<std::io::Result<()>>())
    } else {
        let l = tokio::net::TcpListener::bind(&cfg.metrics_addr)
            .await
            .with_context(|| format!("binding metrics_addr {}", cfg.metrics_addr))?;
        tracing::info!(metrics = %cfg.metrics_addr, "metrics listening");
        tokio::spawn(metrics::serve(l, state.metrics.clone()))
    };
    let edge_task = tokio::spawn(edge::serve(
        edge_l,
        edge::Edge {
            master: m,
            master_once: master::client(channels, std::time::Duration::ZERO),
            cache: state.cache.clone(),
            metrics: state.metrics.clone(),
            limiter: state.limiter.clone(),
        },
    ));
    let app = router(state);
    // Every listener is bound: ready for systemd (Type=notify).
    if let Err(e) = cube_proto::systemd::notify_ready() {
        tracing::warn!(error = %e, "sd_notify READY failed");
    }
    tokio::select! {
        r = axum::serve(api, app).tcp_nodelay(true) => r.context("api server")?,
        r = edge_task => r.context("edge task")?.context("edge server")?,
        r = metrics_task => r.context("metrics task")?.context("metrics server")?,
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
