//! The OCI bundle of a gVisor sandbox: its disk mounted on the host as the root, cube-agent
//! (the node's binary, bind-mounted read-only) as PID 1 with the namespace runtime's
//! capabilities and `no_new_privs`, in its own PID, IPC, UTS and mount namespaces. The
//! network is the sandbox's own namespace, named by path: runsc's sandbox process joins it and
//! gVisor's netstack takes its interface (with no path runsc would make a new, empty one).

use serde_json::{json, Value};
use std::path::Path;

/// Capability names of `crate::runtime::namespace::init::AGENT_CAPS`, by number.
fn cap_name(n: u32) -> Option<&'static str> {
    Some(match n {
        0 => "CAP_CHOWN",
        1 => "CAP_DAC_OVERRIDE",
        3 => "CAP_FOWNER",
        4 => "CAP_FSETID",
        5 => "CAP_KILL",
        6 => "CAP_SETGID",
        7 => "CAP_SETUID",
        8 => "CAP_SETPCAP",
        10 => "CAP_NET_BIND_SERVICE",
        13 => "CAP_NET_RAW",
        18 => "CAP_SYS_CHROOT",
        29 => "CAP_AUDIT_WRITE",
        31 => "CAP_SETFCAP",
        _ => return None,
    })
}

/// What the bundle is made of.
pub struct Bundle<'a> {
    pub root: &'a Path,
    /// The sandbox's network namespace (`/run/.../netns/<key>`).
    pub netns: &'a Path,
    pub hostname: &'a str,
    pub agent_host: &'a Path,
    pub agent_path: &'a str,
    pub agent_args: &'a [String],
    pub tmp_size_mib: u64,
    pub run_size_mib: u64,
}

impl Bundle<'_> {
    /// `config.json`.
    pub fn config(&self) -> Result<Value, String> {
        let caps: Vec<&str> = crate::runtime::namespace::init::AGENT_CAPS
            .iter()
            .map(|&n| cap_name(n).ok_or_else(|| format!("capability {n} has no name here")))
            .collect::<Result<_, _>>()?;
        let mut args = vec![self.agent_path.to_string()];
        args.extend(self.agent_args.iter().cloned());
        let tmpfs = |dst: &str, mib: u64, mode: &str| {
            json!({"destination": dst, "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "nodev", format!("mode={mode}"), format!("size={mib}m")]})
        };
        Ok(json!({
            "ociVersion": "1.0.2",
            "process": {
                "terminal": false,
                "user": {"uid": 0, "gid": 0},
                "args": args,
                "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"],
                "cwd": "/",
                "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
                "noNewPrivileges": true,
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576u64, "soft": 1048576u64}]
            },
            "root": {"path": self.root, "readonly": false},
            "hostname": self.hostname,
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
                {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
                 "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
                {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "nodev", "mode=1777"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
                tmpfs("/tmp", self.tmp_size_mib, "1777"),
                tmpfs("/run", self.run_size_mib, "755"),
                {"destination": self.agent_path, "type": "bind", "source": self.agent_host, "options": ["bind", "ro"]}
            ],
            "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                                     {"type": "network", "path": self.netns}]}
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_is_pid_1_with_the_namespace_runtimes_capabilities() {
        let args = vec!["--addr".to_string(), "0.0.0.0:49983".into()];
        let b = Bundle {
            root: Path::new("/r"),
            netns: Path::new("/run/cube/netns/k"),
            hostname: "sbx",
            agent_host: Path::new("/usr/lib/cube/cube-agent"),
            agent_path: "/run/cube-agent",
            agent_args: &args,
            tmp_size_mib: 16,
            run_size_mib: 8,
        };
        let c = b.config().unwrap();
        assert_eq!(c["process"]["args"][0], "/run/cube-agent");
        assert_eq!(c["process"]["args"][2], "0.0.0.0:49983");
        assert_eq!(c["process"]["noNewPrivileges"], true);
        let caps = c["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert_eq!(
            caps.len(),
            crate::runtime::namespace::init::AGENT_CAPS.len()
        );
        assert!(!caps
            .iter()
            .any(|c| c == "CAP_SYS_ADMIN" || c == "CAP_MKNOD"));
        let ns = c["linux"]["namespaces"].as_array().unwrap();
        assert!(ns.iter().all(|n| n["type"] != "user"));
        // The sandbox's own namespace, never a new empty one (no path) or the host's.
        let net: Vec<_> = ns.iter().filter(|n| n["type"] == "network").collect();
        assert_eq!(net.len(), 1);
        assert_eq!(net[0]["path"], "/run/cube/netns/k");
    }
}
