//! Serving: the gRPC `Node` service and the HTTP port with `/metrics` and `/health`.

use crate::node::Node;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

/// Serves until `shutdown` resolves.
pub async fn serve(
    node: Arc<Node>,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let (tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let http_listener = tokio::net::TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("binding HTTP {http_addr}"))?;
    let grpc_listener = tokio::net::TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("binding gRPC {grpc_addr}"))?;
    let n2 = node.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let n = n2.clone();
                async move {
                    (
                        [("content-type", "text/plain; version=0.0.4")],
                        n.render_metrics(),
                    )
                }
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok\n" }));
    let mut rx1 = tx.subscribe();
    let http = tokio::spawn(async move {
        axum::serve(http_listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx1.recv().await;
            })
            .await
    });
    let mut rx2 = tx.subscribe();
    let svc = cube_proto::nodev1::node_server::NodeServer::new(crate::grpc::NodeService {
        node: node.clone(),
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = &node.host.cfg.tls {
        // Mutual TLS: only holders of a fleet certificate (the master) may call the node.
        builder = builder
            .tls_config(t.server().context("[tls]")?)
            .context("[tls]")?;
    }
    let grpc = tokio::spawn(async move {
        builder
            .add_service(svc)
            .serve_with_incoming_shutdown(tokio_stream_listener(grpc_listener), async move {
                let _ = rx2.recv().await;
            })
            .await
    });
    tracing::info!(%grpc_addr, %http_addr, tls = node.host.cfg.tls.is_some(), "cubelet serving");
    // Both listeners are bound: ready for systemd (Type=notify).
    if let Err(e) = cube_proto::systemd::notify_ready() {
        tracing::warn!(error = %e, "sd_notify READY failed");
    }
    shutdown.await;
    let _ = tx.send(());
    let _ = grpc.await;
    let _ = http.await;
    Ok(())
}

fn tokio_stream_listener(
    l: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(l, |l| async move {
        let r = l.accept().await.map(|(s, _)| {
            let _ = s.set_nodelay(true);
            s
        });
        Some((r, l))
    })
}
