//! Test topology built from network namespaces the test creates (unique names, removed on
//! drop). Nothing is sent outside these namespaces.
//!
//! ```text
//!  guest netns g<i>  [eth0 169.254.77.2/30, 02:cb:e0:00:00:02] ==veth== [vh<i>]  node netns h
//!  node netns h      [up 198.51.100.1/24] ==veth== [eth0 198.51.100.2/24] "internet" netns i
//!                    lo: 169.254.169.254 (metadata-like service)
//!  internet netns i  lo: 203.0.113.5, .6, .53 (servers); no route back to 10.233/16
//! ```
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const INET_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);
pub const INET_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 6);
pub const RESOLVER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

static SEQ: AtomicU32 = AtomicU32::new(0);

pub fn uid() -> String {
    format!(
        "{:x}{:x}",
        std::process::id() & 0xfffff,
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

pub fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("spawn");
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn sh_ok(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .is_ok_and(|o| o.status.success())
}

pub fn sh_out(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("spawn");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn nsx(ns: &str, args: &[&str]) {
    let mut v = vec!["ip", "netns", "exec", ns];
    v.extend_from_slice(args);
    sh(&v);
}

/// A named network namespace, deleted on drop.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(name: String) -> NetNs {
        sh(&["ip", "netns", "add", &name]);
        let ns = NetNs { name };
        nsx(&ns.name, &["ip", "link", "set", "lo", "up"]);
        ns
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Runs `f` on a fresh thread inside network namespace `ns`.
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        enter(&path);
        f()
    })
    .join()
    .expect("thread in netns panicked")
}

pub fn enter(path: &str) {
    let f = std::fs::File::open(path).expect("open netns");
    // SAFETY: valid fd; affects only the calling thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
}

/// A TCP server in `ns` that answers every connection with "<tag> <peer address>".
pub fn tcp_server(ns: &str, addr: SocketAddr, tag: &'static str) {
    let l = in_ns(ns, move || TcpListener::bind(addr).expect("bind"));
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let peer = s
                .peer_addr()
                .map(|p| p.ip().to_string())
                .unwrap_or_default();
            let _ = s.write_all(format!("{tag} {peer}").as_bytes());
        }
    });
}

/// A UDP server in `ns` that echoes "<tag> <peer>" back.
pub fn udp_server(ns: &str, addr: SocketAddr, tag: &'static str) {
    let s = in_ns(ns, move || UdpSocket::bind(addr).expect("bind udp"));
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((_, peer)) = s.recv_from(&mut buf) {
            let _ = s.send_to(format!("{tag} {}", peer.ip()).as_bytes(), peer);
        }
    });
}

/// Connects from `ns` and returns what the server said, or None when it could not connect.
pub fn tcp_get(ns: &str, ip: Ipv4Addr, port: u16) -> Option<String> {
    in_ns(ns, move || {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::from((ip, port)), Duration::from_millis(700))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    })
}

/// Sends one UDP datagram from `ns` and returns the answer, if any.
pub fn udp_get(ns: &str, ip: Ipv4Addr, port: u16) -> Option<String> {
    in_ns(ns, move || {
        let s = UdpSocket::bind("0.0.0.0:0").ok()?;
        s.set_read_timeout(Some(Duration::from_millis(700))).ok()?;
        s.send_to(b"q", (ip, port)).ok()?;
        let mut buf = [0u8; 512];
        let (n, _) = s.recv_from(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
}

/// The whole topology.
pub struct Topo {
    pub id: String,
    pub guests: Vec<NetNs>,
    pub host_ifs: Vec<String>,
    pub pin_root: PathBuf,
    // Dropped last: namespaces go after everything inside them.
    pub inet: NetNs,
    pub node: NetNs,
}

impl Topo {
    pub fn new(n_guests: usize) -> Topo {
        let id = uid();
        let node = NetNs::new(format!("cvs-h-{id}"));
        let inet = NetNs::new(format!("cvs-i-{id}"));
        let h = node.name.clone();
        let i = inet.name.clone();
        nsx(&h, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let up = format!("cu{id}");
        sh(&[
            "ip", "link", "add", &up, "netns", &h, "type", "veth", "peer", "name", "eth0", "netns",
            &i,
        ]);
        nsx(&h, &["ip", "addr", "add", "198.51.100.1/24", "dev", &up]);
        nsx(&h, &["ip", "link", "set", &up, "up"]);
        nsx(
            &h,
            &[
                "ip",
                "route",
                "add",
                "203.0.113.0/24",
                "via",
                "198.51.100.2",
            ],
        );
        nsx(
            &h,
            &["ip", "addr", "add", "169.254.169.254/32", "dev", "lo"],
        );
        nsx(&i, &["ip", "addr", "add", "198.51.100.2/24", "dev", "eth0"]);
        nsx(&i, &["ip", "link", "set", "eth0", "up"]);
        for a in [INET_A, INET_B, RESOLVER] {
            nsx(&i, &["ip", "addr", "add", &format!("{a}/32"), "dev", "lo"]);
        }
        // Lets the "internet" try to reach sandboxes directly (must be refused).
        nsx(
            &i,
            &["ip", "route", "add", "10.233.0.0/16", "via", "198.51.100.1"],
        );

        let mut guests = Vec::new();
        let mut host_ifs = Vec::new();
        for k in 0..n_guests {
            let g = NetNs::new(format!("cvs-g{k}-{id}"));
            let hv = format!("cv{k}{id}");
            sh(&[
                "ip", "link", "add", &hv, "netns", &h, "type", "veth", "peer", "name", "eth0",
                "netns", &g.name,
            ]);
            nsx(
                &g.name,
                &["ip", "link", "set", "eth0", "address", "02:cb:e0:00:00:02"],
            );
            nsx(
                &g.name,
                &["ip", "addr", "add", "169.254.77.2/30", "dev", "eth0"],
            );
            nsx(&g.name, &["ip", "link", "set", "eth0", "up"]);
            nsx(
                &g.name,
                &["ip", "route", "add", "default", "via", "169.254.77.1"],
            );
            nsx(&h, &["ip", "link", "set", &hv, "up"]);
            guests.push(g);
            host_ifs.push(hv);
        }
        let pin_root = PathBuf::from(format!("/tmp/cvs-bpf-{id}"));
        Topo {
            id,
            guests,
            host_ifs,
            pin_root,
            inet,
            node,
        }
    }

    pub fn switch_config(&self) -> cube_vs::SwitchConfig {
        cube_vs::SwitchConfig {
            pin_root: self.pin_root.clone(),
            nft_table: format!("cube_vs_{}", self.id),
            ..Default::default()
        }
    }

    pub fn g(&self, k: usize) -> String {
        self.guests[k].name.clone()
    }

    pub fn h(&self) -> String {
        self.node.name.clone()
    }

    pub fn i(&self) -> String {
        self.inet.name.clone()
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        // The bpffs the switch mounted at the pin root (tests never use /sys/fs/bpf).
        if let Ok(c) = std::ffi::CString::new(self.pin_root.to_string_lossy().as_bytes()) {
            // SAFETY: valid path; a failing umount (nothing mounted) is harmless.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir_all(&self.pin_root);
    }
}
