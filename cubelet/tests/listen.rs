//! The node's control port: plaintext only on loopback (issue: an open, unauthenticated
//! gRPC port is control of the host).

use std::process::Command;

fn run_with(grpc_addr: &str, extra: &str) -> std::process::Output {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("cubelet.toml");
    std::fs::write(
        &cfg,
        format!(
            "grpc_addr = \"{grpc_addr}\"\nhttp_addr = \"127.0.0.1:0\"\ndata_dir = \"{0}/data\"\n\
             run_dir = \"{0}/run\"\ncache_dir = \"{0}/cache\"\n{extra}",
            d.path().display()
        ),
    )
    .unwrap();
    Command::new(env!("CARGO_BIN_EXE_cubelet"))
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .output()
        .unwrap()
}

#[test]
fn refuses_a_non_loopback_grpc_address_without_mutual_tls() {
    for addr in ["0.0.0.0:0", "[::]:0"] {
        let o = run_with(addr, "");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{addr}: started");
        assert!(err.contains("without mutual TLS"), "{addr}: {err}");
    }
}
