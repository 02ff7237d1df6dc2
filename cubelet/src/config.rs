//! cubelet's TOML configuration (`/etc/cube/cubelet.toml`). Every field has a default, so an
//! empty file (or none) is a valid configuration.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/cube/cubelet.toml";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Node id reported to the master; empty = the host name.
    pub node_id: String,
    /// gRPC listen address for the master.
    pub grpc_addr: String,
    /// HTTP listen address for `/metrics` and `/health`.
    pub http_addr: String,
    /// Data directory (templates, sandboxes, pools). Should be XFS with reflink.
    pub data_dir: PathBuf,
    /// Runtime state (network namespace files).
    pub run_dir: PathBuf,
    /// Cache of debootstrap roots, keyed by recipe hash.
    pub cache_dir: PathBuf,
    /// cube-agent binary copied into every template as /sbin/cube-agent.
    pub agent_binary: PathBuf,
    /// Runtime for new sandboxes: "namespace", "gvisor", "microvm" or "auto" (the strongest
    /// this host runs well: microvm with VMX/SVM, else gvisor where `runsc` works, else
    /// namespace).
    pub runtime: String,
    pub microvm: MicroVmConfig,
    pub gvisor: GvisorConfig,
    pub storage: StorageConfig,
    pub sandbox: SandboxConfig,
    pub cgroup: CgroupConfig,
    pub pools: PoolConfig,
    pub network: NetworkConfig,
    /// Per-sandbox metrics history and logs: how often, how many, how long after the end.
    pub journal: crate::journal::JournalConfig,
    /// cube-vs settings: host address pool, guest identity, pin root, nftables table.
    pub switch: cube_vs::SwitchConfig,
    /// Registration with cube-master (empty address = none; the master polls a static list).
    pub master: MasterLink,
    /// `"text"` or `"json"` (one object per line).
    pub log_format: cube_proto::logging::LogFormat,
    /// Mutual TLS for the gRPC server and the link to the master; absent = plaintext.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<cube_proto::tls::TlsConfig>,
}

/// `[master]`: where this node registers and heartbeats.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterLink {
    /// The master's gRPC URL, e.g. `http://10.0.0.1:9090`; empty = do not register.
    pub address: String,
    /// Every cube-master of a fleet with standbys (the leader and the others); when set, used
    /// instead of `address`. Registration and heartbeats go to whichever answers.
    pub addresses: Vec<String>,
    /// One-time join token (from `CreateJoinToken`), needed when the master requires one. Used
    /// once: later registrations present the node secret kept in the data directory.
    pub join_token: String,
    /// gRPC URL the master should use to reach this node; empty = `http://<grpc_addr>` (with
    /// 127.0.0.1 for an unspecified address, so only right on a single host).
    pub advertise: String,
}

impl MasterLink {
    /// The masters to register with: `addresses`, else `address` (none when both are empty).
    pub fn masters(&self) -> Vec<String> {
        let list: Vec<String> = if self.addresses.is_empty() {
            vec![self.address.clone()]
        } else {
            self.addresses.clone()
        };
        list.into_iter()
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect()
    }
}

/// Which switch isolates sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum SwitchKind {
    /// The eBPF switch: per-sandbox host addresses, isolation, egress policy (the default).
    #[default]
    #[serde(rename = "cube-vs")]
    CubeVs,
    /// No switch: sandboxes are NOT isolated from the host or each other (development only).
    #[serde(rename = "none")]
    None,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// `"cube-vs"` (default) or `"none"`.
    pub switch: SwitchKind,
    /// The DNS server sandboxes use (their `/etc/resolv.conf`, written by the agent at init):
    /// the switch lets port 53 reach it, and only it, while a sandbox may reach the internet.
    /// Unset = sandboxes have no resolver (DNS is blocked).
    pub dns_resolver: Option<std::net::Ipv4Addr>,
    /// An address cubelet puts on `lo` for its egress proxy, which admits a sandbox's TCP to
    /// the domain names its policy allows (TLS SNI or HTTP Host; cube-vs redirects to it what
    /// the address rules deny). Unset = no proxy: policies with names are refused. The proxy
    /// resolves names through `dns_resolver` (the system's resolver when that is unset).
    pub egress_proxy: Option<std::net::Ipv4Addr>,
}

/// The `microvm` runtime (cube-shim processes hosting KVM microVMs).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MicroVmConfig {
    /// The cube-shim binary.
    pub shim_binary: PathBuf,
    /// Guest: a PVH vmlinux path (needs hardware KVM), or "agent-standin" (the shim's test
    /// guest standing in for cube-agent; runs on PVM too, for testing the machinery).
    pub guest: String,
    /// Pre-created taps.
    pub taps: u32,
    /// Confine each shim to a mount namespace holding only its files.
    pub jail: bool,
    /// Memory a shim may use beyond the guest's RAM (cgroup limit).
    pub mem_overhead_mib: u64,
}

impl Default for MicroVmConfig {
    fn default() -> Self {
        MicroVmConfig {
            shim_binary: "/usr/lib/cube/cube-shim".into(),
            guest: "/usr/lib/cube/vmlinux".into(),
            taps: 4,
            jail: true,
            mem_overhead_mib: 128,
        }
    }
}

/// The `gvisor` runtime (each sandbox a `runsc` sandbox: gVisor's user-space kernel).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GvisorConfig {
    /// The runsc binary (Debian: `runsc` from bookworm-backports).
    pub runsc: PathBuf,
    /// gVisor platform: "systrap" or "ptrace" ("kvm" needs VMX/SVM). With Debian's runsc
    /// (0.0~20240729) on the PVM build machines, ptrace is faster (pool create 11.9 vs 14.8 ms,
    /// create + first command 47 vs 77 ms p50) and an idle ptrace sandbox costs ~0.2 % of a CPU
    /// where an idle systrap one keeps a 1 ms timer going and costs ~3.5 % (a 2-core host
    /// saturates at ~130 idle systrap sandboxes); but on ptrace some restores come back with a
    /// deaf agent (gVisor #14147 and kin): 8 of 258 before the agent accepted on a blocking
    /// thread, 2 of 296 after, none of 100 on systrap. Whether a restore is deaf depends on
    /// timing as well as on the image (immediate retries of one image stayed deaf, a retry
    /// 15 s later answered), so checking each snapshot by restoring it at once rejected good
    /// ones; systrap stays the default.
    pub platform: String,
    /// More runsc flags, before the command (e.g. "--debug").
    pub extra_args: Vec<String>,
    /// Pause saves a sandbox's processes and memory to disk (`runsc checkpoint`) and stops it,
    /// so a paused sandbox holds no host memory; resume restores it. Off by default: with
    /// Debian's runsc (0.0~20240729) about one restore in ten comes back with its agent's epoll
    /// wedged (gVisor issues #13920 and #14147, fixed upstream in 2026), and such a sandbox
    /// cannot be resumed. Off, pause freezes the sandbox in RAM (its memory stays taken).
    pub pause_to_disk: bool,
}

impl Default for GvisorConfig {
    fn default() -> Self {
        GvisorConfig {
            runsc: "/usr/bin/runsc".into(),
            platform: "systrap".into(),
            extra_args: Vec::new(),
            pause_to_disk: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageConfig {
    /// When the data directory has no reflink: create and mount a loop XFS image there.
    pub xfs_loop_image: Option<PathBuf>,
    pub xfs_loop_size_gib: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// vCPUs of a sandbox whose request names none, and of pooled sandboxes and warm shims.
    /// Keep it equal to the master's `default_vcpus`: a microVM snapshot fits one shape only.
    pub default_vcpus: u32,
    pub default_memory_mib: u64,
    pub max_vcpus: u32,
    pub max_memory_mib: u64,
    pub max_disk_mib: u64,
    /// Most sandboxes on this node (0 = unlimited).
    pub max_sandboxes: u32,
    pub pids_max: u64,
    pub agent_port: u16,
    /// Extra arguments for cube-agent.
    pub agent_args: Vec<String>,
    pub ready_timeout_ms: u32,
    /// A running sandbox whose end time (set by the master) is this long past is killed by
    /// the node itself: a backstop should the master be gone. 0 = never.
    pub end_grace_s: u64,
    pub seccomp: bool,
    /// Sandbox uids and gids 0..id_count are host ids id_base.. (a user namespace): root in a
    /// sandbox is not host root. `user_namespace = false` runs sandboxes as host root (tests).
    pub user_namespace: bool,
    pub id_base: u32,
    pub id_count: u32,
    pub run_size_mib: u64,
    pub tmp_size_mib: u64,
    pub hostname: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CgroupConfig {
    /// Mount point of the cgroup hierarchy (v2, or the directory holding v1 controllers).
    pub root: PathBuf,
    /// Parent cgroup of all sandboxes.
    pub parent: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Pre-created network endpoints (veth + netns).
    pub network: u32,
    /// Endpoints of killed sandboxes kept for reuse (unbound, emptied) up to this many.
    /// Deleting a network namespace holds the kernel's rtnl lock for tens of milliseconds,
    /// which stalls every create that is adding a veth at the time.
    pub network_recycle: u32,
    /// Pre-cloned disks per template in `started`/`disks`.
    pub disks: u32,
    /// Pre-started sandboxes waiting for /init, per template name.
    pub started: BTreeMap<String, u32>,
    /// Templates whose disks are pre-cloned (besides those in `started`).
    pub disk_templates: Vec<String>,
    /// How often the refiller checks levels, in milliseconds.
    pub refill_interval_ms: u64,
    /// After a create takes a pre-started sandbox, how long its replacement waits, in
    /// milliseconds, so that starting it does not slow the rest of that create (0 = at once).
    pub refill_delay_ms: u64,
    /// Pre-started sandboxes started at once while refilling (0 = one per CPU, at most 4):
    /// one at a time cannot keep up with creates that each take a pooled sandbox.
    pub refill_parallelism: u32,
    /// When the pool is empty, how long a create waits for a pre-start under way before
    /// starting a sandbox itself, in milliseconds.
    pub claim_wait_ms: u64,
}

/// Name of [`Config::staging_dir`] under the data dir.
pub const STAGING_DIR: &str = "staging";

impl Default for Config {
    fn default() -> Self {
        Config {
            node_id: String::new(),
            grpc_addr: "127.0.0.1:9091".into(),
            http_addr: "127.0.0.1:9093".into(),
            data_dir: "/var/lib/cube".into(),
            run_dir: "/run/cube".into(),
            cache_dir: "/var/cache/cube/templates".into(),
            agent_binary: "/usr/lib/cube/cube-agent".into(),
            runtime: "namespace".into(),
            microvm: MicroVmConfig::default(),
            gvisor: GvisorConfig::default(),
            storage: StorageConfig::default(),
            sandbox: SandboxConfig::default(),
            cgroup: CgroupConfig::default(),
            pools: PoolConfig::default(),
            network: NetworkConfig::default(),
            journal: Default::default(),
            switch: cube_vs::SwitchConfig::default(),
            master: MasterLink::default(),
            log_format: Default::default(),
            tls: None,
        }
    }
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            xfs_loop_image: None,
            xfs_loop_size_gib: 64,
        }
    }
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            default_vcpus: 2,
            default_memory_mib: 512,
            max_vcpus: 16,
            max_memory_mib: 16384,
            max_disk_mib: 65536,
            max_sandboxes: 0,
            pids_max: 4096,
            agent_port: 49983,
            agent_args: vec![],
            ready_timeout_ms: 10_000,
            end_grace_s: 120,
            seccomp: true,
            user_namespace: true,
            // Above the ids Debian gives users and their /etc/subuid ranges (100000 + 65536 n).
            id_base: 1_000_000_000,
            id_count: 65536,
            run_size_mib: 64,
            tmp_size_mib: 512,
            hostname: "sandbox".into(),
        }
    }
}

impl Default for CgroupConfig {
    fn default() -> Self {
        CgroupConfig {
            root: "/sys/fs/cgroup".into(),
            parent: "cube".into(),
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            network: 8,
            network_recycle: 64,
            disks: 4,
            started: BTreeMap::new(),
            disk_templates: vec![],
            refill_interval_ms: 200,
            refill_delay_ms: 50,
            refill_parallelism: 0,
            claim_wait_ms: 2000,
        }
    }
}

impl Config {
    /// The only place gRPC template imports (`oci_path`, `directory`) may read from: a
    /// root-owned directory under the data dir, so that a caller of the node's port cannot have
    /// it read (and serve to sandboxes) any host path.
    pub fn staging_dir(&self) -> PathBuf {
        self.data_dir.join(STAGING_DIR)
    }

    /// Loads a config file. A missing file at the default path means all defaults; a missing
    /// file given explicitly is an error.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Config> {
        use anyhow::Context;
        let (p, explicit) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_PATH), false),
        };
        match std::fs::read_to_string(&p) {
            Ok(s) => toml::from_str(&s).with_context(|| format!("parsing {}", p.display())),
            Err(e) if !explicit && e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Config::default())
            }
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// The cgroup root to use: on hybrid hosts `/sys/fs/cgroup` holds v1 controllers.
    pub fn node_id(&self) -> String {
        if !self.node_id.is_empty() {
            return self.node_id.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "node".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_all_defaults_and_unknown_keys_fail() {
        let c: Config = toml::from_str("").unwrap();
        assert_eq!(c.grpc_addr, "127.0.0.1:9091");
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/cube"));
        let c: Config =
            toml::from_str("[pools]\nnetwork = 3\n[pools.started]\nbase = 2\n").unwrap();
        assert_eq!(c.pools.network, 3);
        assert_eq!(c.pools.started.get("base"), Some(&2));
        assert!(toml::from_str::<Config>("bogus = 1").is_err());
        // Gone (the started pool sizes the warm shims): refused, not silently ignored.
        assert!(toml::from_str::<Config>("[microvm]\nshims_per_template = 1").is_err());
        assert!(Config::load(Some(Path::new("/nonexistent/cubelet.toml"))).is_err());
        assert_eq!(c.network.switch, SwitchKind::CubeVs);
        assert_eq!(c.switch.host_pool.to_string(), "10.233.0.0/16");
        let c: Config = toml::from_str(
            "[network]\nswitch = \"none\"\n[switch]\nhost_pool = \"10.9.0.0/24\"\nnft_table = \"t1\"\n",
        )
        .unwrap();
        assert_eq!(c.network.switch, SwitchKind::None);
        assert_eq!(c.switch.host_pool.to_string(), "10.9.0.0/24");
        assert!(toml::from_str::<Config>("[network]\nswitch = \"ovs\"").is_err());
        let round: Config = toml::from_str(&toml::to_string(&Config::default()).unwrap()).unwrap();
        assert_eq!(round.switch, cube_vs::SwitchConfig::default());
    }
}
