//! Plain-HTTP routes: /health, /init, /envs, /metrics, /files; auth and signatures; CORS.

mod common;
use common::*;
use serde_json::json;
use std::io::{Read, Write};

fn agent() -> Agent {
    Agent::spawn(&["--default-user", "root"])
}

fn enc(p: &str) -> String {
    p.replace('%', "%25")
        .replace('/', "%2F")
        .replace(' ', "%20")
        .replace('+', "%2B")
        .replace('=', "%3D")
}

fn sign(path: &str, op: &str, user: &str, token: &str, exp: Option<u64>) -> String {
    let mut s = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        s.push_str(&format!(":{e}"));
    }
    // Use the system's sha256sum so the test checks the agent against an independent hash.
    let mut c = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    let mut out = String::new();
    c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    c.wait().unwrap();
    let hex = out.split_whitespace().next().unwrap();
    let bytes: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    use base64::Engine;
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(bytes)
    )
}

#[test]
fn health_version_and_cors() {
    let mut a = agent();
    let r = a.request("GET", "/health", &[], b"");
    assert_eq!(r.status, 204);
    let v = r.header("x-envd-version").unwrap().to_string();
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cube-agent"))
        .arg("--version")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("cube-agent {v}")
    );
    let r = a.request(
        "OPTIONS",
        "/process.Process/Start",
        &[
            ("Origin", "http://x"),
            ("Access-Control-Request-Method", "POST"),
        ],
        b"",
    );
    assert_eq!(r.status, 204);
    assert_eq!(r.header("access-control-allow-methods"), Some("*"));
    let r = a.request("GET", "/nope", &[], b"");
    assert_eq!(r.status, 404);
    a.assert_alive();
}

#[test]
fn init_token_auth_envs_and_newer_wins() {
    let mut a = agent();
    let r = a.request("POST", "/init", &[], br#"{"envVars":{"A":"1"},"accessToken":"T","timestamp":"2026-01-01T00:00:01Z","defaultUser":"root","defaultWorkdir":"/tmp","entropy":"AAECAwQFBgc="}"#);
    assert_eq!(r.status, 204);
    assert!(r.header("x-envd-version").is_some());
    // Everything but the exempt routes now needs the token.
    let r = a.request("GET", "/envs", &[], b"");
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["code"], 401);
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("unauthorized"));
    let r = a.unary("process.Process/List", &json!({}), &[]);
    assert_eq!(r.status, 401);
    assert_eq!(a.request("GET", "/health", &[], b"").status, 204);
    let r = a.request("GET", "/envs", &[("X-Access-Token", "T")], b"");
    assert_eq!(r.json(), json!({"A": "1"}));
    // An older /init is ignored; a newer one applies.
    let r = a.request(
        "POST",
        "/init",
        &[("X-Access-Token", "T")],
        br#"{"envVars":{"A":"old"},"timestamp":"2025-01-01T00:00:00Z"}"#,
    );
    assert_eq!(r.status, 204);
    assert_eq!(
        a.request("GET", "/envs", &[("X-Access-Token", "T")], b"")
            .json(),
        json!({"A": "1"})
    );
    let r = a.request(
        "POST",
        "/init",
        &[("X-Access-Token", "T")],
        br#"{"envVars":{"A":"new"},"timestamp":"2026-01-01T00:00:02Z"}"#,
    );
    assert_eq!(r.status, 204);
    assert_eq!(
        a.request("GET", "/envs", &[("X-Access-Token", "T")], b"")
            .json(),
        json!({"A": "new"})
    );
    // Re-init without the current token is refused.
    assert_eq!(
        a.request("POST", "/init", &[], br#"{"accessToken":"evil"}"#)
            .status,
        401
    );
    assert_eq!(
        a.request("POST", "/init", &[("X-Access-Token", "T")], b"{bad json")
            .status,
        400
    );
    // The default workdir applies to processes.
    let (msgs, _) = a
        .stream(
            "process.Process/Start",
            &json!({"process": {"cmd": "/bin/pwd"}}),
            &[("X-Access-Token", "T")],
        )
        .collect();
    assert_eq!(output(&msgs, "stdout"), "/tmp\n");
    let m = a
        .request("GET", "/metrics", &[("X-Access-Token", "T")], b"")
        .json();
    for k in [
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ] {
        assert!(m.get(k).is_some(), "metrics lacks {k}: {m}");
    }
    assert!(m["mem_total"].as_u64().unwrap() > 0);
    a.assert_alive();
}

#[test]
fn files_signatures() {
    let mut a = agent();
    assert_eq!(
        a.request("POST", "/init", &[], br#"{"accessToken":"TOK"}"#)
            .status,
        204
    );
    let d = TempDir::new("cube-agent-sig");
    let p = d.path("f.txt");
    let r = a.request(
        "POST",
        &format!("/files?path={}", enc(&p)),
        &[("Content-Type", "application/octet-stream")],
        b"x",
    );
    assert_eq!(r.status, 401);
    let sig = sign(&p, "write", "", "TOK", None);
    let r = a.request(
        "POST",
        &format!("/files?path={}&signature={}", enc(&p), enc(&sig)),
        &[("Content-Type", "application/octet-stream")],
        b"signed",
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // A write signature does not allow reading.
    let r = a.request(
        "GET",
        &format!("/files?path={}&signature={}", enc(&p), enc(&sig)),
        &[],
        b"",
    );
    assert_eq!(r.status, 401);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let sig = sign(&p, "read", "root", "TOK", Some(exp));
    let r = a.request(
        "GET",
        &format!(
            "/files?path={}&username=root&signature={}&signature_expiration={exp}",
            enc(&p),
            enc(&sig)
        ),
        &[],
        b"",
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"signed");
    let sig = sign(&p, "read", "", "TOK", Some(1000));
    let r = a.request(
        "GET",
        &format!(
            "/files?path={}&signature={}&signature_expiration=1000",
            enc(&p),
            enc(&sig)
        ),
        &[],
        b"",
    );
    assert_eq!(r.status, 401);
    assert!(String::from_utf8_lossy(&r.body).contains("expired"));
    let r = a.request(
        "GET",
        &format!("/files?path={}", enc(&p)),
        &[("X-Access-Token", "TOK")],
        b"",
    );
    assert_eq!(r.status, 200);
    a.assert_alive();
}

#[test]
fn files_upload_download_variants() {
    let mut a = agent();
    let d = TempDir::new("cube-agent-files");
    // Multipart with several parts whose filenames are full paths.
    let (p1, p2) = (d.path("m/one.txt"), d.path("m/two words.txt"));
    let body = format!(
        "--BOUND\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{p1}\"\r\nContent-Type: application/octet-stream\r\n\r\nONE\r\n--BOUND\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{p2}\"\r\n\r\nTWO\r\n--BOUND--\r\n"
    );
    let r = a.request(
        "POST",
        "/files",
        &[
            ("Content-Type", "multipart/form-data; boundary=BOUND"),
            ("X-Metadata-Owner", "tests"),
        ],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.json(),
        json!([{"path": p1, "name": "one.txt", "type": "file"}, {"path": p2, "name": "two words.txt", "type": "file"}])
    );
    assert_eq!(std::fs::read_to_string(&p2).unwrap(), "TWO");
    let st = a
        .unary("filesystem.Filesystem/Stat", &json!({"path": p1}), &[])
        .json();
    assert_eq!(st["entry"]["metadata"], json!({"owner": "tests"}));

    // Single multipart part with the query path overriding the filename.
    let p3 = d.path("q.txt");
    let body = "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"ignored.txt\"\r\n\r\nQ\r\n--B--\r\n";
    let r = a.request(
        "POST",
        &format!("/files?path={}", enc(&p3)),
        &[("Content-Type", "multipart/form-data; boundary=B")],
        body.as_bytes(),
    );
    assert_eq!(r.json()[0]["path"], p3.as_str());

    // Raw octet-stream, gzip-encoded.
    let p4 = d.path("gz/data.bin");
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&payload).unwrap();
    let gz = gz.finish().unwrap();
    let r = a.request(
        "POST",
        &format!("/files?path={}", enc(&p4)),
        &[
            ("Content-Type", "application/octet-stream"),
            ("Content-Encoding", "gzip"),
        ],
        &gz,
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(std::fs::read(&p4).unwrap(), payload);
    let r = a.request(
        "POST",
        &format!("/files?path={}", enc(&d.path("bad.gz"))),
        &[
            ("Content-Type", "application/octet-stream"),
            ("Content-Encoding", "gzip"),
        ],
        b"not gzip at all",
    );
    assert_eq!(r.status, 400);

    // Download plain and gzipped.
    let r = a.request("GET", &format!("/files?path={}", enc(&p4)), &[], b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.body, payload);
    assert!(r
        .header("content-disposition")
        .unwrap()
        .contains("data.bin"));
    let r = a.request(
        "GET",
        &format!("/files?path={}", enc(&p4)),
        &[("Accept-Encoding", "gzip")],
        b"",
    );
    assert_eq!(r.header("content-encoding"), Some("gzip"));
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(&r.body[..])
        .read_to_end(&mut out)
        .unwrap();
    assert_eq!(out, payload);

    // Errors.
    let r = a.request(
        "GET",
        &format!("/files?path={}", enc(&d.path("missing"))),
        &[],
        b"",
    );
    assert_eq!(r.status, 404);
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("does not exist"));
    let r = a.request(
        "GET",
        &format!("/files?path={}", enc(&d.path("m"))),
        &[],
        b"",
    );
    assert_eq!(r.status, 400);
    let r = a.request(
        "POST",
        "/files",
        &[("Content-Type", "application/octet-stream")],
        b"x",
    );
    assert_eq!(r.status, 400);
    let r = a.request(
        "GET",
        &format!("/files?path={}&username=no-such-user-q", enc(&p1)),
        &[],
        b"",
    );
    assert_eq!(r.status, 401);
    let r = a.request(
        "POST",
        &format!("/files?path={}", enc(&d.path("m"))),
        &[("Content-Type", "application/octet-stream")],
        b"x",
    );
    assert_eq!(r.status, 400);
    a.assert_alive();
}

#[test]
fn upload_to_full_disk_is_507() {
    cube_testkit::require_priv!("cube-agent upload_to_full_disk_is_507");
    let mut a = agent();
    let d = TempDir::new("cube-agent-full");
    let st = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            "size=64k",
            "tmpfs",
            &d.0.display().to_string(),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    struct Unmount(String);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(d.0.display().to_string());
    let big = vec![7u8; 1024 * 1024];
    let r = a.request(
        "POST",
        &format!("/files?path={}", enc(&d.path("big"))),
        &[("Content-Type", "application/octet-stream")],
        &big,
    );
    assert_eq!(r.status, 507, "{}", String::from_utf8_lossy(&r.body));
    a.assert_alive();
}

#[test]
fn files_compose_concatenates() {
    let mut a = agent();
    let d = TempDir::new("cube-agent-compose");
    std::fs::write(d.path("a"), b"hello ").unwrap();
    std::fs::write(d.path("b"), b"world").unwrap();
    let body = json!({"source_paths": [d.path("a"), d.path("b")], "destination": d.path("out/c")});
    let r = a.request(
        "POST",
        "/files/compose",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["size"], "11");
    assert_eq!(std::fs::read(d.path("out/c")).unwrap(), b"hello world");
    let body = json!({"source_paths": [d.path("missing")], "destination": d.path("x")});
    let r = a.request("POST", "/files/compose", &[], body.to_string().as_bytes());
    assert_eq!(r.status, 404);
    let r = a.request("POST", "/files/compose", &[], b"{}");
    assert_eq!(r.status, 400);
    a.assert_alive();
}
