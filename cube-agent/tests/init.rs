//! PID-1 mode, exercised for real: the agent runs as PID 1 of fresh PID/mount/UTS namespaces.

mod common;
use common::*;
use serde_json::json;

#[test]
fn pid1_reaps_orphans_and_sets_hostname() {
    cube_testkit::require_priv!("cube-agent pid1_reaps_orphans_and_sets_hostname");
    let dir = TempDir::new("cube-agent-init");
    let cfg = dir.path("agent.toml");
    // A nonexistent interface: the agent must log and carry on (and not touch the host's eth0).
    std::fs::write(
        &cfg,
        "hostname = \"cube-test-host\"\n[network]\ninterface = \"cubetest0\"\n",
    )
    .unwrap();
    let mut a = Agent::spawn_cmd(&[
        "unshare",
        "--pid",
        "--fork",
        "--mount",
        "--uts",
        "--mount-proc",
        "--kill-child",
        "{bin}",
        "--addr",
        "{addr}",
        "--config",
        &cfg,
        "--default-user",
        "root",
    ]);
    let run = |cmd: &str| {
        let (msgs, end) = a
            .stream(
                "process.Process/Start",
                &json!({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}}),
                &[],
            )
            .collect();
        assert_eq!(end, json!({}), "{msgs:?}");
        output(&msgs, "stdout")
    };
    // `--init auto` picked init mode because the agent is PID 1.
    assert_eq!(run("echo $PPID; hostname"), "1\ncube-test-host\n");
    // An orphan (re-parented to PID 1) is reaped instead of lingering as a zombie.
    let orphan = run("sleep 0.3 & echo $!").trim().to_string();
    assert!(!orphan.is_empty());
    wait_for("orphan to be reaped", || {
        run(&format!(
            "if [ -e /proc/{orphan} ]; then cut -d' ' -f3 /proc/{orphan}/stat; else echo gone; fi"
        )) == "gone\n"
    });
    // The agent's own children still report their real exit status (not stolen by the reaper).
    let (msgs, _) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 0.1 & exit 42"]}}),
            &[],
        )
        .collect();
    assert_eq!(end_event(&msgs)["exitCode"], 42);
    a.assert_alive();
}

#[test]
fn init_configures_the_interface_and_default_route() {
    cube_testkit::require_priv!("cube-agent init_configures_the_interface_and_default_route");
    // In fresh net/UTS/mount/PID namespaces: a dummy eth0, the agent as init (`--init always`,
    // since the shell is PID 1 there), then read back what the kernel has.
    let script = format!(
        "ip link add eth0 type veth peer name eth0p && ip link set eth0p up || exit 90
         {bin} --addr 127.0.0.1:49983 --init always --config /nonexistent.toml 2>/dev/null &
         for i in $(seq 1 200); do ip -4 route show default | grep -q via && break; sleep 0.05; done
         ip -4 -o addr show dev eth0; ip -4 route show default; ip -o link show lo; hostname",
        bin = env!("CARGO_BIN_EXE_cube-agent")
    );
    let out = std::process::Command::new("unshare")
        .args([
            "--net",
            "--uts",
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            "sh",
            "-c",
            &script,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("inet 169.254.77.2/30"), "{text}");
    assert!(text.contains("default via 169.254.77.1 dev eth0"), "{text}");
    assert!(
        text.contains("UP") || text.contains("LOWER_UP"),
        "lo not up: {text}"
    );
    assert!(
        text.trim_end().ends_with("sandbox"),
        "hostname not set: {text}"
    );
}
