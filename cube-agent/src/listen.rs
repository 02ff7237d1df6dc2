//! The agent's one accept loop: envd (port 49983) and the code interpreter (49999) both serve
//! HTTP/1.1 with keep-alive, one task per connection, from a handler of their own.
//!
//! Connections are accepted by a blocking `accept(2)` on a thread of its own, not through the
//! runtime's epoll: gVisor before 2026 can restore a checkpoint in which an epoll interest of
//! the listening socket never reports again (a wakeup that lands while the Sentry saves
//! corrupts the ready list; gVisor #13920, #14147), and an agent restored that way accepts
//! TCP handshakes but never answers. A blocking accept waits on the socket itself.

use http::{Request, Response};
use hyper::body::Incoming;
use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// Accepts connections forever and serves each with `handler`. `name` labels the log lines.
pub async fn serve<H, F, B>(listener: TcpListener, name: &'static str, handler: H)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut accepted = match accept_thread(listener, name) {
        Ok(rx) => rx,
        Err(e) => {
            tracing::error!("{name}: cannot accept connections: {e}");
            return;
        }
    };
    while let Some(stream) = accepted.recv().await {
        // Registered with the runtime now, after any restore.
        let stream = match stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpStream::from_std(stream))
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("{name}: taking an accepted connection: {e}");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(
                    hyper_util::rt::TokioIo::new(stream),
                    hyper::service::service_fn(handler),
                );
            if let Err(e) = conn.await {
                tracing::debug!("{name}: connection ended: {e}");
            }
        });
    }
}

/// Accepts on a thread of its own (blocking) and hands each connection over.
fn accept_thread(
    listener: TcpListener,
    name: &'static str,
) -> std::io::Result<tokio::sync::mpsc::UnboundedReceiver<std::net::TcpStream>> {
    let listener = listener.into_std()?;
    listener.set_nonblocking(false)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name(format!("{name}-accept"))
        .spawn(move || loop {
            match listener.accept() {
                Ok((s, _)) => {
                    if tx.send(s).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("{name}: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })?;
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_path(req: Request<Incoming>) -> Result<Response<Full<bytes::Bytes>>, Infallible> {
        Ok(Response::new(Full::new(req.uri().path().to_owned().into())))
    }

    #[tokio::test]
    async fn each_connection_is_served_and_keeps_alive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, "test", echo_path));
        // Two connections at once, each asking twice on the same connection.
        let mut conns = [
            tokio::net::TcpStream::connect(addr).await.unwrap(),
            tokio::net::TcpStream::connect(addr).await.unwrap(),
        ];
        for (i, path) in [(0, "/one"), (1, "/two"), (0, "/three")] {
            let conn = &mut conns[i];
            let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
            conn.write_all(req.as_bytes()).await.unwrap();
            let mut buf = vec![0u8; 1024];
            let n = conn.read(&mut buf).await.unwrap();
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
            assert!(text.ends_with(path), "{text}");
        }
    }
}
