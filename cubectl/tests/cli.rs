//! Argument and connection errors: clear one-line messages and the right exit status, no root
//! and no running Cube needed.

use std::process::{Command, Output};

fn cubectl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cubectl"))
        .args(args)
        .env_remove("CUBE_MASTER_URL")
        .env_remove("CUBE_DATA_DIR")
        .output()
        .expect("running cubectl")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit status `code` and a single-line `cubectl: ...` error containing `want`.
fn assert_fails(o: &Output, code: i32, want: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {e}");
    assert!(e.contains(want), "expected {want:?} in: {e}");
    assert!(!e.contains("panicked"), "{e}");
    if code == 1 {
        assert_eq!(e.trim_end().lines().count(), 1, "not one line: {e}");
        assert!(e.starts_with("cubectl: "), "{e}");
        assert!(o.stdout.is_empty(), "stdout on error: {:?}", o.stdout);
    }
}

/// Held for this process and never listened on.
fn closed_port() -> u16 {
    cube_testkit::reserve_port()
}

#[test]
fn usage_errors_exit_2() {
    assert_fails(&cubectl(&["frobnicate"]), 2, "unrecognized subcommand");
    assert_fails(&cubectl(&["up", "--api-port", "abc"]), 2, "--api-port");
    assert_fails(&cubectl(&["up", "--api-port", "70000"]), 2, "--api-port");
    assert_fails(
        &cubectl(&["up", "--runtime", "docker"]),
        2,
        "possible values",
    );
    assert_fails(
        &cubectl(&["up", "--xfs-size-gib", "0"]),
        2,
        "--xfs-size-gib",
    );
    assert_fails(
        &cubectl(&["template", "build", "t", "--dir", "/a", "--oci", "/b"]),
        2,
        "cannot be used with",
    );
    assert_fails(
        &cubectl(&["template", "build", "t", "--packages", "curl"]),
        2,
        "--debootstrap",
    );
    assert_fails(
        &cubectl(&["sandbox", "list", "--metadata", "novalue"]),
        2,
        "KEY=VALUE",
    );
    assert_fails(&cubectl(&["sandbox", "kill"]), 2, "<ID>");
    assert_fails(&cubectl(&["node", "drain"]), 2, "<ID>");
    let help = cubectl(&["--help"]);
    assert!(help.status.success());
    let h = String::from_utf8_lossy(&help.stdout);
    for c in [
        "up",
        "down",
        "status",
        "template",
        "sandbox",
        "node",
        "apikey",
        "join-token",
    ] {
        assert!(h.contains(c), "{c} missing from --help: {h}");
    }
}

#[test]
fn template_build_needs_a_source_before_connecting() {
    // The recipe is checked before any connection: the master address is unreachable here.
    let url = format!("http://127.0.0.1:{}", closed_port());
    let o = cubectl(&["--master", &url, "template", "build", "py"]);
    assert_fails(&o, 1, "--debootstrap SUITE, --oci PATH or --dir PATH");
    let o = cubectl(&[
        "--master",
        &url,
        "template",
        "build",
        "py",
        "--dir",
        "no/such/dir",
    ]);
    assert_fails(&o, 1, "no/such/dir");
}

#[test]
fn unreachable_or_invalid_master_is_one_line() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    for args in [
        vec!["sandbox", "list"],
        vec!["node", "list"],
        vec!["apikey", "list"],
        vec!["template", "list"],
        vec!["--json", "sandbox", "kill", "x"],
    ] {
        let mut a = vec!["--master", url.as_str()];
        a.extend(args);
        assert_fails(
            &cubectl(&a),
            1,
            &format!("cannot reach cube-master at {url}"),
        );
    }
    // The environment variable is honoured too.
    let o = Command::new(env!("CARGO_BIN_EXE_cubectl"))
        .args(["node", "list"])
        .env("CUBE_MASTER_URL", &url)
        .output()
        .unwrap();
    assert_fails(&o, 1, &url);
    assert_fails(
        &cubectl(&["--master", "not a url", "sandbox", "list"]),
        1,
        "invalid master address",
    );
}

#[test]
fn status_and_down_of_a_directory_without_install() {
    let dir = std::env::temp_dir().join(format!("cubectl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    assert_fails(
        &cubectl(&["status", "--data-dir", d]),
        1,
        "no Cube install in",
    );
    let root = unsafe { libc_geteuid() } == 0;
    assert_fails(
        &cubectl(&["down", "--data-dir", d]),
        1,
        if root {
            "no Cube install in"
        } else {
            "must run as root"
        },
    );
    // A corrupted install record is named, not a panic.
    std::fs::write(dir.join("up.toml"), "format = 1\n[ports]\napi = 1\n").unwrap();
    assert_fails(
        &cubectl(&["status", "--data-dir", d]),
        1,
        "not a valid install record",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
