//! Mutual TLS end to end with certificates made by the real `deploy/install.sh` PKI commands:
//! a gRPC server configured from a `[tls]` section accepts a client holding a certificate signed
//! by the fleet CA and refuses every other client (no certificate, a certificate from another
//! CA, plaintext). The service is tonic-health, standing in for any Cube service: the TLS layer
//! under test is the same.

use cube_proto::tls::{self, TlsConfig};
use std::path::{Path, PathBuf};
use std::process::Command;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn install_sh() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/install.sh")
}

fn pki(args: &[&str]) {
    let out = Command::new("bash")
        .arg(install_sh())
        .args(args)
        .output()
        .expect("running deploy/install.sh");
    assert!(
        out.status.success(),
        "install.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn cfg(pki_dir: &Path, name: &str) -> TlsConfig {
    TlsConfig {
        ca: pki_dir.join("ca.pem"),
        cert: pki_dir.join(format!("{name}.pem")),
        key: pki_dir.join(format!("{name}.key")),
        server_name: String::new(),
    }
}

async fn check(url: &str, tls: Option<&TlsConfig>) -> Result<(), String> {
    let ch = tls::endpoint(url, tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(std::time::Duration::from_secs(3))
        .timeout(std::time::Duration::from_secs(3))
        .connect_lazy();
    HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|_| ())
        .map_err(|s| s.to_string())
}

#[tokio::test]
async fn only_clients_with_a_fleet_certificate_get_in() {
    let d = tempfile::tempdir().unwrap();
    let fleet = d.path().join("fleet");
    let rogue = d.path().join("rogue");
    let f = fleet.to_str().unwrap();
    let r = rogue.to_str().unwrap();
    pki(&["--make-ca", f]);
    // Idempotent: a second run keeps the CA (re-issuing it would orphan every node).
    let ca1 = std::fs::read(fleet.join("ca.pem")).unwrap();
    pki(&["--make-ca", f]);
    assert_eq!(ca1, std::fs::read(fleet.join("ca.pem")).unwrap());
    pki(&[
        "--issue-cert",
        "master",
        "--pki",
        f,
        "--san",
        "IP:127.0.0.1,DNS:localhost",
    ]);
    pki(&[
        "--issue-cert",
        "node-a",
        "--pki",
        f,
        "--san",
        "IP:127.0.0.1",
    ]);
    pki(&["--make-ca", r]);
    pki(&[
        "--issue-cert",
        "intruder",
        "--pki",
        r,
        "--san",
        "IP:127.0.0.1",
    ]);

    let server_tls = cfg(&fleet, "master").server().unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .tls_config(server_tls)
            .unwrap()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    let url = format!("http://127.0.0.1:{port}");

    // A fleet member: works (and http:// is upgraded to TLS because [tls] is set).
    let good = cfg(&fleet, "node-a");
    check(&url, Some(&good))
        .await
        .expect("fleet client refused");

    // A certificate signed by another CA: the server refuses it.
    let intruder = TlsConfig {
        ca: fleet.join("ca.pem"),
        ..cfg(&rogue, "intruder")
    };
    let e = check(&url, Some(&intruder)).await.unwrap_err();
    assert!(!e.is_empty());

    // No client certificate at all: refused.
    let ch = tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(
                    std::fs::read(fleet.join("ca.pem")).unwrap(),
                ))
                .domain_name("127.0.0.1"),
        )
        .unwrap()
        .connect_lazy();
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(r.is_err(), "a client without a certificate got in");

    // Plaintext: refused.
    assert!(check(&url, None).await.is_err());

    // The client side also verifies the server: trusting only the rogue CA fails.
    let wrong_trust = TlsConfig {
        ca: rogue.join("ca.pem"),
        ..cfg(&fleet, "node-a")
    };
    assert!(check(&url, Some(&wrong_trust)).await.is_err());

    // And the name: a certificate for 127.0.0.1 does not pass as another host.
    let wrong_name = TlsConfig {
        server_name: "master.example".into(),
        ..cfg(&fleet, "node-a")
    };
    assert!(check(&url, Some(&wrong_name)).await.is_err());

    // The fleet client still works after all the refusals (the server did not wedge).
    check(&url, Some(&good))
        .await
        .expect("fleet client refused");
}
