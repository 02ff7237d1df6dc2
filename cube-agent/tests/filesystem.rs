//! `filesystem.Filesystem` RPCs and watchers.

mod common;
use common::*;
use serde_json::json;

fn agent() -> Agent {
    Agent::spawn(&["--default-user", "root"])
}

#[test]
fn stat_makedir_list_move_remove() {
    let mut a = agent();
    let d = TempDir::new("cube-agent-fs");
    let r = a.unary(
        "filesystem.Filesystem/MakeDir",
        &json!({"path": d.path("a/b")}),
        &[],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["entry"]["type"], "FILE_TYPE_DIRECTORY");
    let r = a.unary(
        "filesystem.Filesystem/MakeDir",
        &json!({"path": d.path("a/b")}),
        &[],
    );
    assert_eq!(r.status, 409);
    assert_eq!(r.json()["code"], "already_exists");
    std::fs::write(d.path("a/f.txt"), b"hello").unwrap();
    std::fs::write(d.path("a/b/deep.txt"), b"x").unwrap();
    std::os::unix::fs::symlink(d.path("a/f.txt"), d.path("a/link")).unwrap();

    let st = a
        .unary(
            "filesystem.Filesystem/Stat",
            &json!({"path": d.path("a/f.txt")}),
            &[],
        )
        .json();
    let e = &st["entry"];
    assert_eq!(e["name"], "f.txt");
    assert_eq!(e["type"], "FILE_TYPE_FILE");
    assert_eq!(e["size"], "5");
    assert_eq!(e["permissions"], "-rw-r--r--");
    assert_eq!(e["owner"], "root");
    assert!(e["modifiedTime"].as_str().unwrap().ends_with('Z'));
    let l = a
        .unary(
            "filesystem.Filesystem/Stat",
            &json!({"path": d.path("a/link")}),
            &[],
        )
        .json();
    assert_eq!(l["entry"]["isSymlink"], true);
    assert_eq!(l["entry"]["symlinkTarget"], d.path("a/f.txt"));

    let list = a
        .unary(
            "filesystem.Filesystem/ListDir",
            &json!({"path": d.path("a"), "depth": 1}),
            &[],
        )
        .json();
    let names: Vec<&str> = list["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["b", "f.txt", "link"]);
    let list = a
        .unary(
            "filesystem.Filesystem/ListDir",
            &json!({"path": d.path("a"), "depth": 2}),
            &[],
        )
        .json();
    assert_eq!(list["entries"].as_array().unwrap().len(), 4);
    let r = a.unary(
        "filesystem.Filesystem/ListDir",
        &json!({"path": d.path("a/f.txt")}),
        &[],
    );
    assert_eq!(r.json()["code"], "invalid_argument");

    let mv = a.unary(
        "filesystem.Filesystem/Move",
        &json!({"source": d.path("a/f.txt"), "destination": d.path("new/dir/g.txt")}),
        &[],
    );
    assert_eq!(mv.status, 200);
    assert_eq!(mv.json()["entry"]["path"], d.path("new/dir/g.txt"));
    let r = a.unary(
        "filesystem.Filesystem/Remove",
        &json!({"path": d.path("a")}),
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(!std::path::Path::new(&d.path("a")).exists());
    let r = a.unary(
        "filesystem.Filesystem/Remove",
        &json!({"path": d.path("a")}),
        &[],
    );
    assert_eq!(r.status, 404);
    let r = a.unary(
        "filesystem.Filesystem/Stat",
        &json!({"path": d.path("nope")}),
        &[],
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["code"], "not_found");
    let r = a.unary("filesystem.Filesystem/Stat", &json!({"path": ""}), &[]);
    assert_eq!(r.json()["code"], "invalid_argument");
    a.assert_alive();
}

#[test]
fn relative_paths_resolve_against_home() {
    let mut a = agent();
    let name = unique("cube-agent-rel");
    let r = a.unary("filesystem.Filesystem/MakeDir", &json!({"path": name}), &[]);
    assert_eq!(r.json()["entry"]["path"], format!("/root/{name}"));
    std::fs::remove_dir(format!("/root/{name}")).unwrap();
    a.assert_alive();
}

#[test]
fn watch_dir_stream_and_polling_watcher() {
    let mut a = agent();
    let d = TempDir::new("cube-agent-watch");
    std::fs::create_dir(d.path("sub")).unwrap();
    let mut s = a.stream(
        "filesystem.Filesystem/WatchDir",
        &json!({"path": d.0.display().to_string(), "recursive": true, "includeEntry": true}),
        &[],
    );
    assert_eq!(s.next().unwrap().1, json!({"start": {}}));
    std::fs::write(d.path("sub/new.txt"), b"1").unwrap();
    let mut seen = false;
    for _ in 0..10 {
        let (_, ev) = s.next().unwrap();
        if ev["filesystem"]["name"] == "sub/new.txt"
            && ev["filesystem"]["type"] == "EVENT_TYPE_CREATE"
        {
            assert_eq!(ev["filesystem"]["entry"]["name"], "new.txt");
            seen = true;
            break;
        }
    }
    assert!(seen, "no create event for sub/new.txt");
    drop(s);

    let w = a
        .unary(
            "filesystem.Filesystem/CreateWatcher",
            &json!({"path": d.0.display().to_string()}),
            &[],
        )
        .json();
    let id = w["watcherId"].as_str().unwrap().to_string();
    std::fs::write(d.path("polled.txt"), b"1").unwrap();
    std::fs::remove_file(d.path("polled.txt")).unwrap();
    let mut events = Vec::new();
    wait_for("polled events", || {
        let r = a
            .unary(
                "filesystem.Filesystem/GetWatcherEvents",
                &json!({"watcherId": id}),
                &[],
            )
            .json();
        events.extend(r["events"].as_array().unwrap().clone());
        events.iter().any(|e| e["type"] == "EVENT_TYPE_REMOVE")
    });
    assert!(events
        .iter()
        .any(|e| e["name"] == "polled.txt" && e["type"] == "EVENT_TYPE_CREATE"));
    assert_eq!(
        a.unary(
            "filesystem.Filesystem/RemoveWatcher",
            &json!({"watcherId": id}),
            &[]
        )
        .status,
        200
    );
    let r = a.unary(
        "filesystem.Filesystem/GetWatcherEvents",
        &json!({"watcher_id": id}),
        &[],
    );
    assert_eq!(r.status, 404);
    let (_, end) = a
        .stream(
            "filesystem.Filesystem/WatchDir",
            &json!({"path": d.path("missing")}),
            &[],
        )
        .collect();
    assert_eq!(end["error"]["code"], "not_found");
    a.assert_alive();
}

#[test]
fn user_rights_apply_through_symlinks() {
    cube_testkit::require_priv!("cube-agent user_rights_apply_through_symlinks");
    use std::os::unix::fs::PermissionsExt;
    let mut a = agent();
    let d = TempDir::new("cube-agent-perm");
    std::fs::set_permissions(&d.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir(d.path("secret")).unwrap();
    std::fs::set_permissions(d.path("secret"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(d.path("secret/key"), b"s3cret").unwrap();
    std::fs::create_dir(d.path("pub")).unwrap();
    std::fs::set_permissions(d.path("pub"), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::symlink(d.path("secret/key"), d.path("pub/key-link")).unwrap();
    std::os::unix::fs::symlink(d.path("secret"), d.path("pub/dir-link")).unwrap();
    let nobody = format!("Basic {}", b64(b"nobody:"));
    let h = [("Authorization", nobody.as_str())];

    let r = a.unary(
        "filesystem.Filesystem/Stat",
        &json!({"path": d.path("pub/key-link")}),
        &h,
    );
    // The link itself is visible, but its target's attributes are not (type falls back).
    assert_ne!(r.json()["entry"]["size"], "6");
    let r = a.unary(
        "filesystem.Filesystem/ListDir",
        &json!({"path": d.path("pub/dir-link")}),
        &h,
    );
    assert_eq!(r.status, 403, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["code"], "permission_denied");
    let r = a.unary(
        "filesystem.Filesystem/Remove",
        &json!({"path": d.path("pub/dir-link/key")}),
        &h,
    );
    assert_eq!(r.status, 403);
    assert!(std::path::Path::new(&d.path("secret/key")).exists());
    let r = a.unary(
        "filesystem.Filesystem/Move",
        &json!({"source": d.path("pub/dir-link/key"), "destination": d.path("pub/stolen")}),
        &h,
    );
    assert_eq!(r.status, 403);

    let enc = |p: &str| p.replace('/', "%2F");
    let r = a.request(
        "GET",
        &format!(
            "/files?path={}&username=nobody",
            enc(&d.path("pub/key-link"))
        ),
        &[],
        b"",
    );
    assert_eq!(r.status, 403, "{}", String::from_utf8_lossy(&r.body));
    assert!(!String::from_utf8_lossy(&r.body).contains("s3cret"));
    let r = a.request(
        "POST",
        &format!(
            "/files?path={}&username=nobody",
            enc(&d.path("pub/dir-link/planted"))
        ),
        &[("Content-Type", "application/octet-stream")],
        b"x",
    );
    assert_eq!(r.status, 403);
    assert!(!std::path::Path::new(&d.path("secret/planted")).exists());
    // Overwriting a root-owned file through a link fails too.
    let r = a.request(
        "POST",
        &format!(
            "/files?path={}&username=nobody",
            enc(&d.path("pub/key-link"))
        ),
        &[("Content-Type", "application/octet-stream")],
        b"pwned",
    );
    assert_eq!(r.status, 403);
    assert_eq!(std::fs::read(d.path("secret/key")).unwrap(), b"s3cret");

    // What nobody may write is owned by nobody.
    let r = a.request(
        "POST",
        &format!("/files?path={}&username=nobody", enc(&d.path("pub/mine/f"))),
        &[("Content-Type", "application/octet-stream")],
        b"ok",
    );
    assert_eq!(r.status, 200);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(d.path("pub/mine/f")).unwrap().uid(),
        65534
    );
    assert_eq!(std::fs::metadata(d.path("pub/mine")).unwrap().uid(), 65534);
    a.assert_alive();
}
