//! IPv4 addresses of a name, as the node sees them: from the configured resolver (one UDP
//! query, simple-dns frames it) or, without one, from the system's.

use std::net::Ipv4Addr;
use std::time::Duration;

use simple_dns::rdata::RData;
use simple_dns::{Name, Packet, Question, CLASS, QCLASS, QTYPE, TYPE};

const TRIES: usize = 2;
const TRY_TIMEOUT: Duration = Duration::from_millis(1500);

/// The A records of `name`; empty when it has none.
pub async fn lookup_v4(server: Option<Ipv4Addr>, name: &str) -> std::io::Result<Vec<Ipv4Addr>> {
    let Some(server) = server else {
        let addrs = tokio::net::lookup_host((name, 0)).await?;
        return Ok(addrs
            .filter_map(|a| match a.ip() {
                std::net::IpAddr::V4(v) => Some(v),
                _ => None,
            })
            .collect());
    };
    let bad = |e: simple_dns::SimpleDnsError| std::io::Error::other(format!("DNS: {e}"));
    let id = query_id();
    let mut q = Packet::new_query(id);
    q.set_flags(simple_dns::PacketFlag::RECURSION_DESIRED);
    q.questions.push(Question::new(
        Name::new(name).map_err(bad)?,
        QTYPE::TYPE(TYPE::A),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    let wire = q.build_bytes_vec().map_err(bad)?;
    let sock = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
    sock.connect((server, 53)).await?;
    let mut buf = vec![0u8; 4096];
    for _ in 0..TRIES {
        sock.send(&wire).await?;
        let Ok(r) = tokio::time::timeout(TRY_TIMEOUT, sock.recv(&mut buf)).await else {
            continue;
        };
        let n = r?;
        let Ok(p) = Packet::parse(&buf[..n]) else {
            continue;
        };
        if p.id() != id {
            continue;
        }
        return Ok(p
            .answers
            .iter()
            .filter_map(|rr| match &rr.rdata {
                RData::A(a) => Some(Ipv4Addr::from(a.address)),
                _ => None,
            })
            .collect());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("DNS server {server} did not answer for {name}"),
    ))
}

fn query_id() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (t as u16) ^ NEXT.fetch_add(0x9e37, Ordering::Relaxed)
}
