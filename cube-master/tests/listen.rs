//! The master's control port: plaintext only on loopback.

#[test]
fn refuses_a_non_loopback_grpc_address_without_mutual_tls() {
    let d = tempfile::tempdir().unwrap();
    for addr in ["0.0.0.0:0", "192.0.2.1:9090"] {
        let cfg = d.path().join("master.toml");
        let db = d.path().join("m.db");
        std::fs::write(
            &cfg,
            format!(
                "grpc_addr = \"{addr}\"\ndatabase_url = \"sqlite://{}?mode=rwc\"\nmetrics_addr = \"\"\n",
                db.display()
            ),
        )
        .unwrap();
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_cube-master"))
            .arg("--config")
            .arg(&cfg)
            .arg("run")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{addr}: started");
        assert!(err.contains("without mutual TLS"), "{addr}: {err}");
        assert!(!db.exists(), "{addr}: opened the database before refusing");
    }
}
