//! `cubectl up` / `status` / `down` with the real daemons (root): an install in a temporary data
//! directory on a non-default API port serves E2B HTTP creates with the printed variables, a
//! second install coexists, and `down` leaves no process, mount, switch state or cgroup behind.
//!
//! Needs the daemons next to cubectl (`cargo build -p cubelet -p cube-master -p cube-api
//! -p cube-agent`), and uses `CUBE_AGENT_BIN` for the agent when set. The `base` template is built
//! from a directory of host binaries, so no debootstrap is involved.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_cubectl"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn cubectl(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_cubectl"))
        .args(args)
        .env_remove("CUBE_MASTER_URL")
        .env_remove("CUBE_DATA_DIR")
        .output()
        .expect("running cubectl");
    eprintln!(
        "$ cubectl {}\n  -> {:?}\n  stdout: {}\n  stderr: {}",
        args.join(" "),
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).trim(),
        String::from_utf8_lossy(&o.stderr).trim()
    );
    o
}

fn ok(args: &[&str]) -> String {
    let o = cubectl(args);
    assert!(
        o.status.success(),
        "cubectl {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn json(args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let out = ok(&a);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

/// `curl` with a status code as the last line of its output.
fn curl(args: &[&str]) -> (u16, String) {
    let o = Command::new("curl")
        .args(["-sS", "-m", "60", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl");
    let s = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = s.rsplit_once('\n').unwrap_or(("", &s));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Two consecutive free ports (API and edge).
fn free_pair() -> u16 {
    cube_testkit::reserve_ports(2)
}

fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let st = s
                .rsplit_once(')')
                .map(|(_, r)| r.trim_start().chars().next());
            !matches!(st, Some(Some('Z')) | Some(Some('X')))
        })
        .unwrap_or(false)
}

fn mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| Path::new(m).starts_with(dir))
        .collect()
}

/// Tears an install down even when the test fails half-way.
struct Install {
    dir: PathBuf,
}

impl Install {
    fn d(&self) -> &str {
        self.dir.to_str().unwrap()
    }
}

impl Drop for Install {
    fn drop(&mut self) {
        if self.dir.join("up.toml").exists() {
            let _ = cubectl(&["down", "--purge", "--data-dir", self.d()]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Env {
    api: String,
    sandbox: String,
    key: String,
}

fn parse_exports(out: &str) -> Env {
    let line = out
        .lines()
        .find(|l| l.starts_with("export "))
        .unwrap_or_else(|| panic!("no export line in {out:?}"));
    let get = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} missing in {line}"))
            .to_string()
    };
    Env {
        api: get("E2B_API_URL"),
        sandbox: get("E2B_SANDBOX_URL"),
        key: get("E2B_API_KEY"),
    }
}

fn create(e: &Env) -> String {
    let (code, body) = curl(&[
        "-X",
        "POST",
        &format!("{}/sandboxes", e.api),
        "-H",
        &format!("X-API-Key: {}", e.key),
        "-H",
        "Content-Type: application/json",
        "-d",
        r#"{"templateID":"base","timeout":120,"metadata":{"by":"cubectl-test"}}"#,
    ]);
    assert_eq!(code, 201, "create: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["sandboxID"].as_str().unwrap().to_string()
}

#[test]
fn up_status_second_install_and_down() {
    cube_testkit::require_priv!("cubectl up/status/down with the real daemons");
    let bins = bin_dir();
    for b in ["cubelet", "cube-master", "cube-api"] {
        assert!(
            bins.join(b).exists(),
            "{} missing: build the daemons first (cargo build -p cubelet -p cube-master -p cube-api -p cube-agent)",
            bins.join(b).display()
        );
    }
    let agent = std::env::var("CUBE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| bins.join("cube-agent"));
    assert!(
        agent.exists(),
        "{} missing (CUBE_AGENT_BIN or cargo build -p cube-agent)",
        agent.display()
    );

    let id = std::process::id();
    let a = Install {
        dir: PathBuf::from(format!("/var/tmp/cubectl-test-{id}-a")),
    };
    let b = Install {
        dir: PathBuf::from(format!("/var/tmp/cubectl-test-{id}-b")),
    };
    let host_root = a.dir.with_extension("root");
    let _ = std::fs::remove_dir_all(&host_root);
    let st = Command::new(bins.join("cubelet"))
        .arg("host-root")
        .arg(&host_root)
        .status()
        .unwrap();
    assert!(st.success(), "cubelet host-root");
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _root_guard = Rm(host_root.clone());

    // --- first install, non-default API port, namespace runtime.
    let port_a = free_pair();
    let t0 = Instant::now();
    let out = ok(&[
        "up",
        "--data-dir",
        a.d(),
        "--api-port",
        &port_a.to_string(),
        "--runtime",
        "namespace",
        "--base-dir",
        host_root.to_str().unwrap(),
        "--agent",
        agent.to_str().unwrap(),
        "--xfs-size-gib",
        "4",
        "--pool",
        "0",
    ]);
    eprintln!("first up took {:?}", t0.elapsed());
    let env = parse_exports(&out);
    assert_eq!(env.api, format!("http://127.0.0.1:{port_a}"));
    assert_eq!(env.sandbox, format!("http://127.0.0.1:{}", port_a + 1));
    assert!(env.key.starts_with("e2b_"), "{}", env.key);
    assert!(a.dir.join("up.toml").exists() && a.dir.join("cubelet.toml").exists());

    // The printed variables work: create, reach the agent through the edge, kill.
    let sid = create(&env);
    let (code, body) = curl(&[
        &format!("{}/health", env.sandbox),
        "-H",
        &format!("E2b-Sandbox-Id: {sid}"),
        "-H",
        "E2b-Sandbox-Port: 49983",
    ]);
    assert!(
        (200..300).contains(&code),
        "agent health via the edge: {code} {body}"
    );
    let listed = json(&["sandbox", "list", "--data-dir", a.d()]);
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == sid.as_str() && s["metadata"]["by"] == "cubectl-test"),
        "{listed}"
    );
    let (code, body) = curl(&[
        "-X",
        "DELETE",
        &format!("{}/sandboxes/{sid}", env.api),
        "-H",
        &format!("X-API-Key: {}", env.key),
    ]);
    assert_eq!(code, 204, "kill: {body}");
    let (code, _) = curl(&[
        &format!("{}/v2/sandboxes", env.api),
        "-H",
        "X-API-Key: e2b_0000000000000000000000000000000000000000",
    ]);
    assert_eq!(code, 401, "a wrong key is refused");

    // One sandbox left running for `down` to clean up.
    let left = create(&env);

    // --- status: stable JSON fields.
    let s = json(&["status", "--data-dir", a.d()]);
    assert_eq!(s["up"], true, "{s}");
    assert_eq!(s["runtime"], "namespace", "{s}");
    assert_eq!(s["urls"]["api"], env.api.as_str());
    assert_eq!(s["urls"]["sandbox"], env.sandbox.as_str());
    assert_eq!(s["sandboxes"]["running"], 1, "{s}");
    assert!(
        s["templates"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == "base"),
        "{s}"
    );
    let daemons = s["daemons"].as_array().unwrap();
    assert_eq!(daemons.len(), 3);
    let pids_a: Vec<u64> = daemons
        .iter()
        .map(|d| {
            assert_eq!(
                (d["running"].as_bool(), d["healthy"].as_bool()),
                (Some(true), Some(true)),
                "{d}"
            );
            d["pid"].as_u64().unwrap()
        })
        .collect();
    let nodes = s["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0]["status"], "ready");
    // The other commands find this install's master through --data-dir.
    let n = json(&["node", "list", "--data-dir", a.d()]);
    assert_eq!(n[0]["id"], nodes[0]["id"]);

    // `up` again is idempotent: same variables, nothing restarted.
    let again = parse_exports(&ok(&["up", "--data-dir", a.d()]));
    assert_eq!(
        (again.api, again.key.clone()),
        (env.api.clone(), env.key.clone())
    );
    let s2 = json(&["status", "--data-dir", a.d()]);
    let pids2: Vec<u64> = s2["daemons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids2, pids_a);
    // Its API port is fixed once chosen.
    let o = cubectl(&[
        "up",
        "--data-dir",
        a.d(),
        "--api-port",
        &(port_a + 10).to_string(),
    ]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--api-port"));

    // --- a second install (another data dir and API port, runtime auto, no template) coexists.
    let port_b = free_pair();
    let out_b = ok(&[
        "up",
        "--data-dir",
        b.d(),
        "--api-port",
        &port_b.to_string(),
        "--no-base",
        "--agent",
        agent.to_str().unwrap(),
        "--xfs-size-gib",
        "4",
        "--pool",
        "0",
    ]);
    let env_b = parse_exports(&out_b);
    assert_eq!(env_b.api, format!("http://127.0.0.1:{port_b}"));
    let sb = json(&["status", "--data-dir", b.d()]);
    assert_eq!(sb["up"], true, "{sb}");
    assert!(
        ["namespace", "gvisor", "microvm"].contains(&sb["runtime"].as_str().unwrap_or("")),
        "{sb}"
    );
    assert_ne!(sb["urls"]["master"], s["urls"]["master"]);
    let ua: toml::Table =
        toml::from_str(&std::fs::read_to_string(a.dir.join("up.toml")).unwrap()).unwrap();
    let ub: toml::Table =
        toml::from_str(&std::fs::read_to_string(b.dir.join("up.toml")).unwrap()).unwrap();
    for k in ["pin_root", "nft_table", "host_pool"] {
        assert_ne!(ua["switch"][k], ub["switch"][k], "{k} shared");
    }
    assert_ne!(ua["cgroup_parent"], ub["cgroup_parent"]);
    // The first install still serves.
    assert_eq!(json(&["status", "--data-dir", a.d()])["up"], true);
    let (code, body) = curl(&[
        &format!("{}/sandboxes/{left}", env.api),
        "-H",
        &format!("X-API-Key: {}", env.key),
    ]);
    assert_eq!(code, 200, "{body}");

    // --- down: nothing of the first install is left; the second is untouched.
    let d = json(&["down", "--data-dir", a.d()]);
    assert_eq!(d["sandboxesKilled"], 1, "{d}");
    assert_eq!(d["problems"].as_array().unwrap().len(), 0, "{d}");
    let end = Instant::now() + Duration::from_secs(10);
    while pids_a.iter().any(|p| alive(*p)) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    for p in &pids_a {
        assert!(!alive(*p), "pid {p} still alive after down");
    }
    assert_eq!(mounts_under(&a.dir), Vec::<String>::new());
    let sw = &ua["switch"];
    assert!(
        !Path::new(sw["pin_root"].as_str().unwrap()).exists(),
        "pins left"
    );
    let nft = Command::new("nft")
        .args(["list", "table", "ip", sw["nft_table"].as_str().unwrap()])
        .output()
        .unwrap();
    assert!(!nft.status.success(), "nft table left");
    let routes = Command::new("ip")
        .args([
            "-4",
            "route",
            "show",
            "root",
            sw["host_pool"].as_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(routes.stdout.is_empty(), "routes left");
    let cg = ua["cgroup_parent"].as_str().unwrap();
    for h in ["", "memory", "pids", "freezer"] {
        assert!(
            !Path::new("/sys/fs/cgroup").join(h).join(cg).exists(),
            "cgroup {h}/{cg} left"
        );
    }
    // Data is kept: templates, database, key.
    assert!(a.dir.join("node.xfs").exists() && a.dir.join("api-key").exists());
    let s = cubectl(&["--json", "status", "--data-dir", a.d()]);
    assert_eq!(s.status.code(), Some(3), "status of a stopped install");
    let s: Value = serde_json::from_slice(&s.stdout).unwrap();
    assert_eq!(s["up"], false);
    assert_eq!(json(&["status", "--data-dir", b.d()])["up"], true);

    // --- down --purge removes the second install entirely.
    ok(&["down", "--purge", "--data-dir", b.d()]);
    assert!(!b.dir.exists());
    assert_eq!(mounts_under(&b.dir), Vec::<String>::new());
}
