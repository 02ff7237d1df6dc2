//! vs-bench: how fast cube-vs fills an interface pool and what its programs cost per packet.
//!
//! Everything runs in network namespaces this binary creates (`vsb-*`) and removes; the pin
//! root is a private bpffs under /tmp. No traffic leaves those namespaces. Needs root.
//!
//! 1. Pool fill: create N persistent taps (as a VMM pool would), bring them up and attach the
//!    programs (netlink cls_bpf); also TCX for a smaller sample. Then bind/unbind cost (the
//!    create path).
//! 2. Datapath overhead: a TCP bulk stream and a 1-byte request/response loop from the node
//!    netns to a "guest" netns over a veth pair, without programs (plain routed addresses) and
//!    through the switch (host address -> fixed guest address).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use cube_vs::{AttachMode, SandboxNet, Switch, SwitchConfig};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "cube-vs pool fill rate and per-packet overhead")]
struct Args {
    /// Taps to create and attach (netlink mode).
    #[arg(long, default_value_t = 1000)]
    pool: usize,
    /// Taps to attach in TCX mode (slow: ~25 ms each).
    #[arg(long, default_value_t = 20)]
    tcx: usize,
    /// Seconds per traffic measurement.
    #[arg(long, default_value_t = 3)]
    secs: u64,
    /// Output directory (default benches/results/vs-bench-<unix time>/).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if !out.status.success() {
        bail!("{args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn nsx(ns: &str, args: &[&str]) -> Result<()> {
    let mut v = vec!["ip", "netns", "exec", ns];
    v.extend_from_slice(args);
    sh(&v)
}

struct Ns(String);
impl Ns {
    fn new(name: String) -> Result<Ns> {
        sh(&["ip", "netns", "add", &name])?;
        let ns = Ns(name);
        nsx(&ns.0, &["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}
impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).with_context(|| path.clone())?;
    std::thread::spawn(move || {
        // SAFETY: valid fd; affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("thread in {ns} panicked"))
}

/// A private bpffs for the pins, unmounted on drop.
struct PinRoot(PathBuf);
impl Drop for PinRoot {
    fn drop(&mut self) {
        if let Ok(c) = std::ffi::CString::new(self.0.to_string_lossy().as_bytes()) {
            // SAFETY: valid path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const TUNSETIFF: libc::c_ulong = 0x400454ca;
const TUNSETPERSIST: libc::c_ulong = 0x400454cb;

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Creates a persistent tap the way a VMM pool would, and brings it up.
fn create_tap(name: &str) -> std::io::Result<()> {
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: valid fd and a properly sized ifreq.
    unsafe {
        if libc::ioctl(tun.as_raw_fd(), TUNSETIFF, &mut req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::ioctl(tun.as_raw_fd(), TUNSETPERSIST, 1) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if s < 0 {
            return Err(std::io::Error::last_os_error());
        }
        req.flags = 0;
        let mut ok = libc::ioctl(s, libc::SIOCGIFFLAGS, &mut req) >= 0;
        req.flags |= libc::IFF_UP as libc::c_short;
        ok = ok && libc::ioctl(s, libc::SIOCSIFFLAGS, &mut req) >= 0;
        let err = std::io::Error::last_os_error();
        libc::close(s);
        if !ok {
            return Err(err);
        }
    }
    Ok(())
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn stats(name: &str, mut us: Vec<f64>) -> serde_json::Value {
    let n = us.len();
    let mean = us.iter().sum::<f64>() / n.max(1) as f64;
    json!({"name": name, "n": n, "mean_us": mean, "p50_us": pct(&mut us, 0.5), "p99_us": pct(&mut us, 0.99)})
}

fn pool_bench(id: &str, n: usize, mode: AttachMode, tag: &str) -> Result<serde_json::Value> {
    let ns = Ns::new(format!("vsb-p{tag}-{id}"))?;
    let root = PinRoot(PathBuf::from(format!("/tmp/vsb-bpf-{tag}-{id}")));
    let cfg = SwitchConfig {
        pin_root: root.0.clone(),
        attach_mode: mode,
        masquerade: false,
        ..Default::default()
    };
    let tag = tag.to_string();
    let r = in_ns(&ns.0, move || -> Result<serde_json::Value> {
        let t0 = Instant::now();
        let mut sw = Switch::open(cfg)?;
        let open_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (mut create, mut attach) = (Vec::new(), Vec::new());
        let mut ports = Vec::new();
        let wall = Instant::now();
        for k in 0..n {
            let name = format!("vt{k}");
            let t = Instant::now();
            create_tap(&name).with_context(|| format!("tap {name}"))?;
            let t1 = Instant::now();
            ports.push(sw.attach(&name)?);
            create.push((t1 - t).as_secs_f64() * 1e6);
            attach.push(t1.elapsed().as_secs_f64() * 1e6);
        }
        let wall_s = wall.elapsed().as_secs_f64();
        let (mut bind, mut unbind) = (Vec::new(), Vec::new());
        for (k, p) in ports.iter().enumerate().take(200) {
            let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 233, 0, 1)) + k as u32);
            let t = Instant::now();
            sw.bind(p, &SandboxNet::new(addr))?;
            bind.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            sw.unbind(p)?;
            unbind.push(t.elapsed().as_secs_f64() * 1e6);
        }
        sw.teardown()?;
        Ok(json!({
            "mode": tag,
            "interfaces": n,
            "switch_open_ms": open_ms,
            "wall_s": wall_s,
            "interfaces_per_s": n as f64 / wall_s,
            "create_tap_up": stats("create_tap_up", create),
            "attach": stats("attach", attach),
            "bind": stats("bind", bind),
            "unbind": stats("unbind", unbind),
        }))
    })??;
    drop(ns);
    drop(root);
    Ok(r)
}

/// Node netns `h`, guest netns `g`, veth `vb<id>` (node side) <-> `eth0` (guest side).
struct Pair {
    h: Ns,
    g: Ns,
    hv: String,
}

fn pair(id: &str, tag: &str, plain: bool) -> Result<Pair> {
    let h = Ns::new(format!("vsb-h{tag}-{id}"))?;
    let g = Ns::new(format!("vsb-g{tag}-{id}"))?;
    let hv = format!("vb{tag}{id}");
    sh(&[
        "ip", "link", "add", &hv, "netns", &h.0, "type", "veth", "peer", "name", "eth0", "netns",
        &g.0,
    ])?;
    nsx(&h.0, &["ip", "link", "set", &hv, "up"])?;
    nsx(&g.0, &["ip", "link", "set", "eth0", "up"])?;
    if plain {
        nsx(&h.0, &["ip", "addr", "add", "192.0.2.1/30", "dev", &hv])?;
        nsx(&g.0, &["ip", "addr", "add", "192.0.2.2/30", "dev", "eth0"])?;
    } else {
        nsx(&h.0, &["ip", "addr", "add", "192.0.2.1/32", "dev", "lo"])?;
        nsx(
            &g.0,
            &["ip", "link", "set", "eth0", "address", "02:cb:e0:00:00:02"],
        )?;
        nsx(
            &g.0,
            &["ip", "addr", "add", "169.254.77.2/30", "dev", "eth0"],
        )?;
        nsx(
            &g.0,
            &["ip", "route", "add", "default", "via", "169.254.77.1"],
        )?;
    }
    Ok(Pair { h, g, hv })
}

/// Bulk stream and 1-byte ping-pong from the node to `target:49983` in the guest.
fn traffic(p: &Pair, target: Ipv4Addr, secs: u64) -> Result<(f64, f64)> {
    let l = in_ns(&p.g.0, || TcpListener::bind("0.0.0.0:49983"))??;
    let server = std::thread::spawn(move || {
        // First connection: sink. Second: echo.
        if let Ok((mut s, _)) = l.accept() {
            let mut buf = vec![0u8; 1 << 16];
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        }
        if let Ok((mut s, _)) = l.accept() {
            let _ = s.set_nodelay(true);
            let mut b = [0u8; 1];
            while matches!(s.read(&mut b), Ok(1)) {
                if s.write_all(&b).is_err() {
                    break;
                }
            }
        }
    });
    let dur = Duration::from_secs(secs);
    let r = in_ns(&p.h.0, move || -> Result<(f64, f64)> {
        let addr = SocketAddr::from((target, 49983));
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        let buf = vec![0x5au8; 1 << 16];
        let t = Instant::now();
        let mut sent = 0u64;
        while t.elapsed() < dur {
            s.write_all(&buf)?;
            sent += buf.len() as u64;
        }
        let gbps = sent as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9;
        drop(s);
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_nodelay(true)?;
        let t = Instant::now();
        let mut n = 0u64;
        let mut b = [0u8; 1];
        while t.elapsed() < dur {
            s.write_all(&[1])?;
            s.read_exact(&mut b)?;
            n += 1;
        }
        let rr = n as f64 / t.elapsed().as_secs_f64();
        Ok((gbps, rr))
    })??;
    let _ = server.join();
    Ok(r)
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("vs-bench needs root (netns, taps, bpf)");
    }
    if !cube_vs::datapath_built() {
        bail!("cube-vs was built without its eBPF object (clang missing)");
    }
    let id = format!("{:x}", std::process::id() & 0xfffff);
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("benches/results/vs-bench-{unix}")));

    eprintln!("pool fill: {} taps, netlink cls_bpf ...", args.pool);
    let nl = pool_bench(&id, args.pool, AttachMode::Netlink, "nl")?;
    eprintln!("pool fill: {} taps, TCX ...", args.tcx);
    let tcx = pool_bench(&id, args.tcx, AttachMode::Tcx, "tcx")?;

    eprintln!("datapath: plain veth ...");
    let plain = pair(&id, "p", true)?;
    let (g0, rr0) = traffic(&plain, Ipv4Addr::new(192, 0, 2, 2), args.secs)?;
    drop(plain);

    eprintln!("datapath: through the switch ...");
    let sw_pair = pair(&id, "s", false)?;
    let root = PinRoot(PathBuf::from(format!("/tmp/vsb-bpf-dp-{id}")));
    let cfg = SwitchConfig {
        pin_root: root.0.clone(),
        masquerade: false,
        ..Default::default()
    };
    let hv = sw_pair.hv.clone();
    let host = Ipv4Addr::new(10, 233, 0, 2);
    let sw = in_ns(&sw_pair.h.0, move || -> Result<Switch> {
        let mut sw = Switch::open(cfg)?;
        let p = sw.attach(&hv)?;
        sw.bind(&p, &SandboxNet::new(host))?;
        Ok(sw)
    })??;
    let (g1, rr1) = traffic(&sw_pair, host, args.secs)?;
    let ifindex = sw
        .adopt_existing()
        .first()
        .map(|p| p.port.ifindex)
        .unwrap_or(0);
    let counters = sw.counters(ifindex)?;
    in_ns(&sw_pair.h.0, move || sw.teardown())??;
    drop(sw_pair);
    drop(root);

    let rr_overhead_us = (1e6 / rr1 - 1e6 / rr0) / 2.0; // two packets (one each way) per round trip
    let result = json!({
        "bench": "vs-bench",
        "unix_time": unix,
        "pool_netlink": nl,
        "pool_tcx": tcx,
        "datapath": {
            "plain_gbps": g0, "switch_gbps": g1,
            "plain_rr_per_s": rr0, "switch_rr_per_s": rr1,
            "overhead_us_per_packet_rr": rr_overhead_us,
            "switch_counters": {
                "from_guest": {"packets": counters.from_guest.packets, "bytes": counters.from_guest.bytes, "drops": counters.from_guest.drops},
                "to_guest": {"packets": counters.to_guest.packets, "bytes": counters.to_guest.bytes, "drops": counters.to_guest.drops},
            }
        },
        "target_interfaces_per_s": 500,
    });

    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    println!("| metric | value |");
    println!("|---|---|");
    for (label, v) in [("netlink", &nl), ("tcx", &tcx)] {
        println!(
            "| pool fill ({label}, {} taps): interfaces/s (create+up+attach) | {:.0} |",
            v["interfaces"],
            f(v, "interfaces_per_s")
        );
        println!(
            "| {label}: create tap + up, mean / p99 µs | {:.0} / {:.0} |",
            f(&v["create_tap_up"], "mean_us"),
            f(&v["create_tap_up"], "p99_us")
        );
        println!(
            "| {label}: attach, mean / p99 µs | {:.0} / {:.0} |",
            f(&v["attach"], "mean_us"),
            f(&v["attach"], "p99_us")
        );
        println!(
            "| {label}: bind (create path), mean / p99 µs | {:.0} / {:.0} |",
            f(&v["bind"], "mean_us"),
            f(&v["bind"], "p99_us")
        );
        println!(
            "| {label}: unbind, mean / p99 µs | {:.0} / {:.0} |",
            f(&v["unbind"], "mean_us"),
            f(&v["unbind"], "p99_us")
        );
        println!(
            "| {label}: Switch::open ms | {:.1} |",
            f(v, "switch_open_ms")
        );
    }
    println!("| TCP bulk node→guest, plain veth Gbit/s | {g0:.2} |");
    println!("| TCP bulk node→guest, through switch Gbit/s | {g1:.2} |");
    println!("| TCP 1-byte RR/s, plain veth | {rr0:.0} |");
    println!("| TCP 1-byte RR/s, through switch | {rr1:.0} |");
    println!("| datapath overhead per packet (from RR), µs | {rr_overhead_us:.2} |");
    let pass = f(&nl, "interfaces_per_s") >= 500.0;
    println!(
        "| target ≥ 500 interfaces/s (netlink) | {} |",
        if pass { "PASS" } else { "FAIL" }
    );

    std::fs::create_dir_all(&out).with_context(|| out.display().to_string())?;
    let path = out.join("vs-bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&result)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
