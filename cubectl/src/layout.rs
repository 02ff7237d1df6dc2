//! The layout of one single-host install (`cubectl up`): which ports, directories, switch
//! resources and cgroup it owns. Chosen once, at the first `up` on a data directory, and recorded
//! in `DATA_DIR/up.toml` (versioned and checksummed) so that `down`, `status` and the other
//! commands find the same install, and two installs with different data directories coexist.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};

/// Data directory of the default install.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cube";
/// The E2B REST port of the default install.
pub const DEFAULT_API_PORT: u16 = 3000;
/// File name of the install record inside the data directory.
pub const UP_FILE: &str = "up.toml";
/// Version of the `up.toml` format this cubectl reads and writes.
pub const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("no Cube install in {0}: {1} is missing (run `cubectl up --data-dir {0}` first)")]
    NotSetUp(String, String),
    #[error("reading {0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0} is not a valid install record: {1}")]
    Parse(String, String),
    #[error("{0} was written by a newer cubectl (format {1}, this one reads {max})", max = FORMAT)]
    Format(String, u32),
    #[error("{0} was modified or is corrupted (checksum mismatch); it is written by `cubectl up` and must not be edited: run `cubectl down --purge --data-dir {1}` to start over")]
    Checksum(String, String),
    #[error("{0}")]
    Ports(String),
}

/// TCP ports of one install (all bound on 127.0.0.1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ports {
    /// E2B REST API.
    pub api: u16,
    /// Sandbox edge (always `api + 1`, as the E2B SDKs' sandbox URL).
    pub edge: u16,
    pub master_grpc: u16,
    pub cubelet_grpc: u16,
    pub master_metrics: u16,
    pub cubelet_metrics: u16,
    pub api_metrics: u16,
}

/// Node-level cube-vs resources of this install's cubelet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Switch {
    pub pin_root: PathBuf,
    pub nft_table: String,
    pub host_pool: String,
}

/// What `up` set up for a data directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub format: u32,
    /// Absolute data directory (configs, logs, master database, the node's data).
    pub data_dir: PathBuf,
    /// Pid files and the node's network namespace files (tmpfs, cleared at reboot).
    pub run_dir: PathBuf,
    /// cubelet's data directory (the XFS loop mount when `xfs_loop_image` is set).
    pub node_dir: PathBuf,
    /// Sparse XFS image mounted on `node_dir` when the data directory is not on XFS.
    pub xfs_loop_image: Option<PathBuf>,
    pub xfs_loop_size_gib: u64,
    /// Runtime asked for: auto, namespace or microvm.
    pub runtime: String,
    /// Parent cgroup of the node's sandboxes.
    pub cgroup_parent: String,
    pub ports: Ports,
    pub switch: Switch,
    /// Hex SHA-256 (first 16 bytes) of the record with this field empty.
    #[serde(default)]
    pub checksum: String,
}

impl Layout {
    pub fn path(data_dir: &Path) -> PathBuf {
        data_dir.join(UP_FILE)
    }

    pub fn config_path(&self, daemon: &str) -> PathBuf {
        self.data_dir.join(format!("{daemon}.toml"))
    }

    pub fn log_path(&self, daemon: &str) -> PathBuf {
        self.data_dir.join("logs").join(format!("{daemon}.log"))
    }

    pub fn pid_path(&self, daemon: &str) -> PathBuf {
        self.run_dir.join(format!("{daemon}.pid"))
    }

    pub fn api_key_path(&self) -> PathBuf {
        self.data_dir.join("api-key")
    }

    pub fn api_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.api)
    }

    pub fn sandbox_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.edge)
    }

    pub fn master_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.master_grpc)
    }

    pub fn cubelet_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.cubelet_grpc)
    }

    fn digest(&self) -> String {
        let mut c = self.clone();
        c.checksum = String::new();
        // Serializing a plain struct cannot fail; an empty string would simply never match.
        let text = toml::to_string(&c).unwrap_or_default();
        let d = Sha256::digest(text.as_bytes());
        d[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Writes `DATA_DIR/up.toml` atomically.
    pub fn save(&self) -> Result<(), LayoutError> {
        let mut c = self.clone();
        c.checksum = c.digest();
        let body =
            toml::to_string(&c).map_err(|e| LayoutError::Parse(UP_FILE.into(), e.to_string()))?;
        let path = Self::path(&self.data_dir);
        let tmp = path.with_extension("toml.tmp");
        let text = format!(
            "# Written by `cubectl up`: what this install owns. Do not edit (checksummed);\n\
             # the daemons' own settings are in cubelet.toml, cube-master.toml, cube-api.toml.\n{body}"
        );
        let err = |e| LayoutError::Io(path.display().to_string(), e);
        std::fs::write(&tmp, text).map_err(err)?;
        std::fs::rename(&tmp, &path).map_err(err)
    }

    /// Reads and verifies `DATA_DIR/up.toml`.
    pub fn load(data_dir: &Path) -> Result<Layout, LayoutError> {
        let path = Self::path(data_dir);
        let shown = path.display().to_string();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LayoutError::NotSetUp(data_dir.display().to_string(), shown))
            }
            Err(e) => return Err(LayoutError::Io(shown, e)),
        };
        Self::parse(&text, &shown, data_dir)
    }

    fn parse(text: &str, shown: &str, data_dir: &Path) -> Result<Layout, LayoutError> {
        // Look at the version first, so that a newer format says so instead of a field error.
        let v: toml::Table =
            toml::from_str(text).map_err(|e| LayoutError::Parse(shown.into(), e.to_string()))?;
        match v.get("format").and_then(|f| f.as_integer()) {
            Some(f) if f == FORMAT as i64 => {}
            Some(f) => return Err(LayoutError::Format(shown.into(), f as u32)),
            None => return Err(LayoutError::Parse(shown.into(), "no `format`".into())),
        }
        let l: Layout =
            toml::from_str(text).map_err(|e| LayoutError::Parse(shown.into(), e.to_string()))?;
        if l.checksum != l.digest() {
            return Err(LayoutError::Checksum(
                shown.into(),
                data_dir.display().to_string(),
            ));
        }
        Ok(l)
    }
}

/// A short stable tag for a data directory, used to name its switch and cgroup resources.
pub fn tag(data_dir: &Path) -> String {
    // FNV-1a: stable across Rust versions (unlike DefaultHasher).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data_dir.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:08x}", (h ^ (h >> 32)) as u32)
}

/// Host address pool for a non-default install: a /20 (4,094 sandboxes, so a bench can hold
/// 1,000) in 10.234.0.0–10.237.255.255 picked from the data directory's tag, skipping /20s the
/// host already routes (another install's sandboxes).
pub fn host_pool(tag: &str, in_use: &dyn Fn(&str) -> bool) -> String {
    let pool = |idx: u32| format!("10.{}.{}.0/20", 234 + idx / 16, (idx % 16) * 16);
    let start = u32::from_str_radix(tag, 16).unwrap_or(0) % 64;
    (0..64)
        .map(|i| pool((start + i) % 64))
        .find(|p| !in_use(p))
        .unwrap_or_else(|| pool(start))
}

/// Whether a TCP port can be bound on 127.0.0.1 right now.
pub fn port_free(port: u16) -> bool {
    port != 0 && TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// Picks the ports of a new install. The API port and the edge (`api + 1`) must be free; the
/// default install's other ports are the documented 9090–9094, anything else gets free ports
/// counting up from `api + 2`.
pub fn pick_ports(api: u16, free: &dyn Fn(u16) -> bool) -> Result<Ports, LayoutError> {
    if api == 0 || api == u16::MAX {
        return Err(LayoutError::Ports(format!(
            "--api-port {api} is not usable (the edge takes the next port)"
        )));
    }
    for p in [api, api + 1] {
        if !free(p) {
            return Err(LayoutError::Ports(format!(
                "port {p} on 127.0.0.1 is in use (another Cube? choose other ports with --api-port; the edge uses --api-port + 1)"
            )));
        }
    }
    let mut taken = vec![api, api + 1];
    let mut next_free = |want: u16| -> Result<u16, LayoutError> {
        let mut p = want;
        loop {
            if !taken.contains(&p) && free(p) {
                taken.push(p);
                return Ok(p);
            }
            p = p.checked_add(1).ok_or_else(|| {
                LayoutError::Ports(format!("no free port above {want} on 127.0.0.1"))
            })?;
        }
    };
    let wanted: [u16; 5] = if api == DEFAULT_API_PORT {
        [9090, 9091, 9092, 9093, 9094]
    } else {
        let b = api.saturating_add(2);
        [b, b, b, b, b]
    };
    Ok(Ports {
        api,
        edge: api + 1,
        master_grpc: next_free(wanted[0])?,
        cubelet_grpc: next_free(wanted[1])?,
        master_metrics: next_free(wanted[2])?,
        cubelet_metrics: next_free(wanted[3])?,
        api_metrics: next_free(wanted[4])?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Layout {
        Layout {
            format: FORMAT,
            data_dir: "/var/tmp/x".into(),
            run_dir: "/run/cube-1234abcd".into(),
            node_dir: "/var/tmp/x/node".into(),
            xfs_loop_image: Some("/var/tmp/x/node.xfs".into()),
            xfs_loop_size_gib: 8,
            runtime: "auto".into(),
            cgroup_parent: "cube-1234abcd".into(),
            ports: pick_ports(4100, &|_| true).unwrap(),
            switch: Switch {
                pin_root: "/sys/fs/bpf/cube-1234abcd".into(),
                nft_table: "cube_1234abcd".into(),
                host_pool: "10.234.3.0/24".into(),
            },
            checksum: String::new(),
        }
    }

    #[test]
    fn record_round_trips_and_detects_edits() {
        let dir = std::env::temp_dir().join(format!("cubectl-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut l = sample();
        l.data_dir = dir.clone();
        l.save().unwrap();
        let back = Layout::load(&dir).unwrap();
        assert_eq!(back.ports, l.ports);
        assert_eq!(back.switch, l.switch);
        assert!(!back.checksum.is_empty());

        let p = Layout::path(&dir);
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, text.replace("api = 4100", "api = 4200")).unwrap();
        let e = Layout::load(&dir).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");

        std::fs::write(&p, text.replace("format = 1", "format = 7")).unwrap();
        let e = Layout::load(&dir).unwrap_err().to_string();
        assert!(e.contains("newer cubectl (format 7"), "{e}");

        std::fs::write(&p, "not toml [").unwrap();
        assert!(matches!(Layout::load(&dir), Err(LayoutError::Parse(..))));

        std::fs::remove_dir_all(&dir).unwrap();
        let e = Layout::load(&dir).unwrap_err().to_string();
        assert!(e.contains("run `cubectl up"), "{e}");
    }

    #[test]
    fn ports_default_and_derived() {
        let p = pick_ports(3000, &|_| true).unwrap();
        assert_eq!(
            (p.edge, p.master_grpc, p.cubelet_grpc, p.master_metrics),
            (3001, 9090, 9091, 9092)
        );
        assert_eq!((p.cubelet_metrics, p.api_metrics), (9093, 9094));
        // Busy ports are skipped, and no port is handed out twice.
        let p = pick_ports(4100, &|x| x != 4103).unwrap();
        let all = [
            p.api,
            p.edge,
            p.master_grpc,
            p.cubelet_grpc,
            p.master_metrics,
            p.cubelet_metrics,
            p.api_metrics,
        ];
        assert_eq!(all, [4100, 4101, 4102, 4104, 4105, 4106, 4107]);
        let e = pick_ports(4100, &|x| x != 4101).unwrap_err().to_string();
        assert!(e.contains("port 4101") && e.contains("--api-port"), "{e}");
        assert!(pick_ports(0, &|_| true).is_err());
        assert!(pick_ports(65535, &|_| true).is_err());
        assert!(pick_ports(65530, &|_| false).is_err());
    }

    #[test]
    fn tags_and_pools_are_stable_and_skip_used() {
        let t = tag(Path::new("/var/tmp/a"));
        assert_eq!(t, tag(Path::new("/var/tmp/a")));
        assert_ne!(t, tag(Path::new("/var/tmp/b")));
        assert_eq!(t.len(), 8);
        let first = host_pool(&t, &|_| false);
        assert!(
            first.starts_with("10.23") && first.ends_with(".0/20"),
            "{first}"
        );
        let f2 = first.clone();
        let second = host_pool(&t, &move |p| p == f2);
        assert_ne!(first, second);
    }
}
