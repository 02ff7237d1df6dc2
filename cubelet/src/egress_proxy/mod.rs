//! The node's egress proxy: how a sandbox reaches the domain names its policy allows.
//!
//! cube-vs hands it the TCP that a sandbox's address rules deny while its policy allows names
//! (the datapath marks those packets and the switch's nftables table DNATs them here). The
//! proxy knows the sandbox by the connection's source (its host address), reads the name the
//! client asks for (TLS SNI or HTTP Host), and if the sandbox may reach that name, connects to
//! the original port of an address the *node* resolves the name to: the original destination
//! when it is one of them, otherwise the first. So naming an allowed host while connecting to
//! another address never reaches that address. Private, reserved and node-local results are
//! refused (a name is no way around the built-in denies). Anything else is closed.
//!
//! What it cannot see: a second HTTP/1 request with another Host on a kept-alive connection,
//! or a TLS SNI that differs from the inner Host, reach another site only if that site is
//! served from the same addresses as the allowed name (domain fronting, as with any SNI/Host
//! filter).

mod names;
mod resolve;
mod sniff;

pub use names::NameSet;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long a client has to send the name.
const SNIFF_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes read while looking for it.
const SNIFF_MAX: usize = 16 * 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Which names each sandbox (by host address) may reach; cube-vs' hook keeps it in step with
/// the switch.
pub struct Registry {
    by_addr: RwLock<HashMap<Ipv4Addr, Arc<NameSet>>>,
    /// `cube_egress_proxy_connections_total{verdict="admitted"|"refused"}` (register it with
    /// the node's metrics).
    pub connections: prometheus::IntCounterVec,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            by_addr: RwLock::default(),
            connections: prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "cube_egress_proxy_connections_total",
                    "Sandbox connections the egress proxy admitted to an allowed name or refused",
                ),
                &["verdict"],
            )
            .expect("static metric"),
        }
    }
}

impl Registry {
    /// Sets (or, with an empty set, clears) a sandbox's names; returns what it had.
    pub fn set(&self, addr: Ipv4Addr, names: NameSet) -> Option<Arc<NameSet>> {
        let mut m = self.by_addr.write().unwrap_or_else(|p| p.into_inner());
        if names.is_empty() {
            m.remove(&addr)
        } else {
            m.insert(addr, Arc::new(names))
        }
    }

    /// Puts back what [`Registry::set`] returned.
    pub fn restore(&self, addr: Ipv4Addr, old: Option<Arc<NameSet>>) {
        let mut m = self.by_addr.write().unwrap_or_else(|p| p.into_inner());
        match old {
            Some(n) => m.insert(addr, n),
            None => m.remove(&addr),
        };
    }

    pub fn remove(&self, addr: Ipv4Addr) {
        self.restore(addr, None);
    }

    fn get(&self, addr: Ipv4Addr) -> Option<Arc<NameSet>> {
        let m = self.by_addr.read().unwrap_or_else(|p| p.into_inner());
        m.get(&addr).cloned()
    }
}

/// The listening proxy.
pub struct EgressProxy {
    listener: TcpListener,
    registry: Arc<Registry>,
    resolver: Option<Ipv4Addr>,
}

impl EgressProxy {
    /// Puts `ip` on the loopback interface (idempotent; other cubelets on the host may share
    /// it) and listens on an ephemeral port there. `resolver` is where names are looked up
    /// (`None`: the system's resolver).
    pub async fn bind(
        ip: Ipv4Addr,
        resolver: Option<Ipv4Addr>,
        registry: Arc<Registry>,
    ) -> std::io::Result<EgressProxy> {
        let out = tokio::process::Command::new("ip")
            .args(["addr", "replace", &format!("{ip}/32"), "dev", "lo"])
            .output()
            .await?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "ip addr replace {ip}/32 dev lo: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let listener = TcpListener::bind((ip, 0)).await?;
        Ok(EgressProxy {
            listener,
            registry,
            resolver,
        })
    }

    /// Where it listens (the switch's DNAT target).
    pub fn local_addr(&self) -> std::io::Result<SocketAddrV4> {
        match self.listener.local_addr()? {
            std::net::SocketAddr::V4(a) => Ok(a),
            a => Err(std::io::Error::other(format!("not IPv4: {a}"))),
        }
    }

    /// Serves until the runtime stops.
    pub async fn run(self) {
        loop {
            match self.listener.accept().await {
                Ok((s, peer)) => {
                    let (reg, resolver) = (self.registry.clone(), self.resolver);
                    tokio::spawn(async move {
                        let verdict = match serve(s, peer, &reg, resolver).await {
                            Ok(()) => "admitted",
                            Err(why) => {
                                tracing::debug!(%peer, %why, "egress proxy: connection refused");
                                "refused"
                            }
                        };
                        reg.connections.with_label_values(&[verdict]).inc();
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "egress proxy: accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

async fn serve(
    mut s: TcpStream,
    peer: std::net::SocketAddr,
    reg: &Registry,
    resolver: Option<Ipv4Addr>,
) -> Result<(), String> {
    let std::net::IpAddr::V4(src) = peer.ip() else {
        return Err("not IPv4".into());
    };
    let names = reg
        .get(src)
        .ok_or("no sandbox with names at this address")?;
    let orig = original_dst(&s).map_err(|e| format!("original destination: {e}"))?;
    let mut head = Vec::with_capacity(2048);
    let name = tokio::time::timeout(SNIFF_TIMEOUT, read_name(&mut s, &mut head))
        .await
        .map_err(|_| "no name in time".to_string())??;
    if !names.allows(&name) {
        return Err(format!("{name:?} is not allowed"));
    }
    let addrs = tokio::time::timeout(RESOLVE_TIMEOUT, resolve::lookup_v4(resolver, &name))
        .await
        .map_err(|_| format!("resolving {name}: timed out"))?
        .map_err(|e| format!("resolving {name}: {e}"))?;
    let usable: Vec<Ipv4Addr> = addrs.into_iter().filter(|a| reachable(*a)).collect();
    let target = if usable.contains(orig.ip()) {
        *orig.ip()
    } else {
        *usable
            .first()
            .ok_or_else(|| format!("{name} has no address a sandbox may reach"))?
    };
    let mut up = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((target, orig.port())))
        .await
        .map_err(|_| format!("connecting to {target}:{}: timed out", orig.port()))?
        .map_err(|e| format!("connecting to {target}:{}: {e}", orig.port()))?;
    tracing::debug!(%peer, %name, %target, port = orig.port(), "egress proxy: admitted");
    up.write_all(&head).await.map_err(|e| e.to_string())?;
    let _ = tokio::io::copy_bidirectional(&mut s, &mut up).await;
    Ok(())
}

/// Reads until the first bytes name a host (kept in `head`, to be replayed upstream).
async fn read_name(s: &mut TcpStream, head: &mut Vec<u8>) -> Result<String, String> {
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed before naming a host".into());
        }
        head.extend_from_slice(&buf[..n]);
        match sniff::server_name(head) {
            sniff::Sniffed::Name(n) => return Ok(n),
            sniff::Sniffed::NoName => return Err("neither TLS with SNI nor HTTP with Host".into()),
            sniff::Sniffed::More if head.len() >= SNIFF_MAX => {
                return Err("no name in the first 16 KiB".into())
            }
            sniff::Sniffed::More => {}
        }
    }
}

/// Whether a sandbox may be connected to `a`: not in a built-in denied range, not the node.
fn reachable(a: Ipv4Addr) -> bool {
    let Ok(c) = cube_vs::Ipv4Cidr::new(a, 32) else {
        return false;
    };
    if cube_vs::reserved_range_of(&c).is_some() || a.is_broadcast() || a.is_multicast() {
        return false;
    }
    // Binding succeeds only for the node's own addresses.
    std::net::UdpSocket::bind((a, 0)).is_err()
}

/// Where the client meant to connect before the DNAT (conntrack keeps it).
fn original_dst(s: &TcpStream) -> std::io::Result<SocketAddrV4> {
    use std::os::fd::AsRawFd;
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: addr is a sockaddr_in of `len` bytes, which SO_ORIGINAL_DST fills.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}
