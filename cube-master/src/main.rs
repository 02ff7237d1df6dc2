//! cube-master daemon.

use anyhow::Context;
use clap::{Parser, Subcommand};
use cube_master::fleet::Nodes;
use cube_master::grpc::MasterService;
use cube_master::leader::Lease;
use cube_master::ops::Controller;
use cube_master::store::Db;
use cube_master::MasterConfig;
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
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::DefaultConfig => {
            println!("{:#?}", MasterConfig::default());
            Ok(())
        }
        Cmd::Run => {
            let cfg = MasterConfig::load(&cli.config)?;
            let fmt = tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr);
            match cfg.log_format {
                cube_proto::logging::LogFormat::Json => fmt.json().init(),
                cube_proto::logging::LogFormat::Text => fmt.init(),
            }
            // Node links (master -> cubelet) use the same fleet identity as the server.
            cube_proto::tls::set_process_tls(cfg.tls.clone()).context("[tls]")?;
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(run(cfg))
        }
    }
}

async fn run(cfg: MasterConfig) -> anyhow::Result<()> {
    let listen: std::net::SocketAddr = cfg.grpc_addr.parse().context("grpc_addr")?;
    cube_proto::tls::check_listen(listen, cfg.tls.as_ref()).context("grpc_addr")?;
    let db = Db::open(&cfg.database_url)
        .await
        .with_context(|| format!("opening {}", redact_url(&cfg.database_url)))?;
    let nodes = Nodes::new(&cfg.nodes, cfg.node_max_misses)?;
    let addr = cfg.grpc_addr.parse().context("grpc_addr")?;
    let reap = Duration::from_millis(cfg.reaper_interval_ms);
    let poll = Duration::from_millis(cfg.node_poll_interval_ms);
    let metrics_addr = cfg.metrics_addr.clone();
    let key_path = cfg.token_key_path()?;
    let key = cube_master::token::TokenKey::load_or_create(&key_path)?;
    let secrets_path = cfg.secrets_key_path()?;
    let secrets = cube_master::secrets::SecretsKey::load_or_create(&secrets_path)?;
    let ctl = Arc::new(
        Controller::new(cfg, db, nodes)
            .with_token_key(key)
            .with_secrets_key(secrets),
    );
    if !metrics_addr.is_empty() {
        let l = tokio::net::TcpListener::bind(&metrics_addr)
            .await
            .with_context(|| format!("binding metrics_addr {metrics_addr}"))?;
        tracing::info!(addr = %metrics_addr, "metrics on /metrics");
        let c = ctl.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_metrics(c, l).await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        });
    }
    // Other masters on the same PostgreSQL database: lead, or stand by (running, not listening)
    // until the leader is gone.
    let shared = ctl.db.backend() == cube_master::store::Backend::Postgres;
    if shared {
        let _ = cube_proto::systemd::notify_ready();
        let _ = cube_proto::systemd::notify("STATUS=standby: waiting to lead");
    }
    let lease = tokio::select! {
        l = Lease::acquire(&ctl.cfg.database_url, Duration::from_millis(ctl.cfg.standby_poll_ms)) => l.context("taking the lead")?,
        _ = shutdown() => return Ok(()),
    };
    if shared {
        tracing::info!("leading: this master holds its database's leader lock");
        let _ = cube_proto::systemd::notify("STATUS=leading");
    }
    ctl.metrics.leader.set(1);
    ctl.fail_interrupted_creates()
        .await
        .context("failing creates the previous master left unfinished")?;
    ctl.load_nodes().await.context("loading nodes")?;
    ctl.nodes.poll_once().await;
    tokio::spawn(ctl.nodes.clone().run_poller(poll));
    tokio::spawn(
        ctl.clone()
            .run_node_health(poll.min(Duration::from_millis(1000))),
    );
    tokio::spawn(ctl.clone().run_reaper(reap));
    let mut server = tonic::transport::Server::builder();
    if let Some(t) = cube_proto::tls::process_tls() {
        server = server
            .tls_config(t.server().context("[tls]")?)
            .context("[tls]")?;
    }
    // Bind before telling systemd we are ready (Type=notify).
    let incoming = tonic::transport::server::TcpIncoming::new(addr, true, None)
        .map_err(|e| anyhow::anyhow!("binding grpc_addr {addr}: {e}"))?;
    tracing::info!(%addr, tls = cube_proto::tls::process_tls().is_some(), "cube-master listening");
    if let Err(e) = cube_proto::systemd::notify_ready() {
        tracing::warn!(error = %e, "sd_notify READY failed");
    }
    // A leader that lost its lease stops at once: another master may lead by now.
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _ = lost_tx.send(lease.lost().await);
    });
    let mut lost = None;
    server
        .layer(cube_master::metrics::GrpcLayer(ctl.metrics.clone()))
        .add_service(MasterService::new(ctl))
        .serve_with_incoming_shutdown(incoming, async {
            tokio::select! {
                _ = shutdown() => {}
                e = lost_rx => lost = e.ok(),
            }
        })
        .await?;
    let _ = cube_proto::systemd::notify_stopping();
    if let Some(e) = lost {
        anyhow::bail!(
            "lost the lead (its database session ended: {e}); stopping so that a standby leads"
        );
    }
    Ok(())
}

/// Serves `/metrics` on `addr` until the process ends.
async fn serve_metrics(
    ctl: Arc<Controller>,
    listener: tokio::net::TcpListener,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let ctl = ctl.clone();
            async move {
                (
                    [("content-type", "text/plain; version=0.0.4")],
                    ctl.metrics_text().await,
                )
            }
        }),
    );
    axum::serve(listener, app).await
}

/// The URL without its password, for messages.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
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
