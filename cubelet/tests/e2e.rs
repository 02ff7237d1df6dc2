//! End-to-end tests against a real cubelet daemon, real namespaces, cgroups, veths, loop
//! devices and the real cube-agent. Root only.

mod common;

use common::*;
use cube_proto::nodev1 as pb;
use std::time::Duration;
use tonic::Code;

fn state_of(c: &Cubelet, id: &str) -> cubelet::node::SandboxState {
    cubelet::state::read(
        &c.data().join("sandboxes").join(id).join("state.json"),
        cubelet::node::STATE_MAGIC,
        cubelet::node::STATE_VERSION,
    )
    .unwrap()
}

fn file_len(pid: i32, path: &str) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/root{path}"))
        .map(|m| m.len())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_lifecycle_commands_files_pause_resume_kill() {
    cube_testkit::require_priv!("cubelet::sandbox_lifecycle");
    let mut c = Cubelet::new("life", Opts::default());
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("life1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sb.runtime, "namespace");
    assert_eq!(sb.state, pb::SandboxState::Running as i32);
    assert!(!sb.host_interface.is_empty());
    // A create without a pool records each of its phases once.
    assert!(!sb.from_pool);
    let body = http_get(&c.http, "/metrics").await;
    for ph in [
        "disk", "endpoint", "cgroup", "prepare", "launch", "veth", "policy", "healthy", "init",
        "total",
    ] {
        assert!(
            body.contains(&format!(
                "cube_create_phase_seconds_count{{phase=\"{ph}\"}} 1\n"
            )),
            "phase {ph}: {body}"
        );
    }

    // A command through the agent sees the env var from /init, runs as `user`, in its own
    // hostname and pid namespace, with the guest network identity.
    let (code, out) = sh(&sb, "echo $FOO; id -u; cat /marker; echo $$").await;
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "bar", "{out}");
    assert_eq!(lines[1], "1000", "{out}");
    assert_eq!(lines[2], "mini template");
    let (_, out) = sh(&sb, "cat /proc/net/dev | grep -c eth0; cat /sys/class/net/eth0/address; ls /proc | grep -c '^[0-9]'").await;
    let l: Vec<&str> = out.lines().collect();
    assert_eq!(l[0], "1");
    assert_eq!(l[1], "02:cb:e0:00:00:02");
    assert!(
        l[2].parse::<u32>().unwrap() < 10,
        "sandbox sees host processes: {out}"
    );

    // Files: written inside, visible through the sandbox's own root only.
    let (code, _) = sh(
        &sb,
        "echo hello > /home/user/f.txt && mkdir -p /home/user/d",
    )
    .await;
    assert_eq!(code, 0);
    let (_, out) = sh(&sb, "cat /home/user/f.txt").await;
    assert_eq!(out, "hello\n");
    let st = state_of(&c, "life1");
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{}/root/home/user/f.txt", st.pid)).unwrap(),
        "hello\n"
    );
    assert!(
        !std::path::Path::new("/home/user/f.txt").exists()
            || std::fs::read_to_string("/home/user/f.txt").unwrap() != "hello\n"
    );

    // Root inside keeps Docker's capabilities less CAP_MKNOD, under no_new_privs and a
    // seccomp filter (what the filter refuses: tests/isolation).
    let (_, status) = sh(
        &sb,
        "grep -E '^(CapBnd|NoNewPrivs|Seccomp):' /proc/self/status",
    )
    .await;
    for want in ["CapBnd:\t00000000a00425fb", "NoNewPrivs:\t1", "Seccomp:\t2"] {
        assert!(status.contains(want), "{want} in {status}");
    }
    // Its init is in a devices cgroup that allows only the nodes of its /dev (v1 hosts).
    if std::path::Path::new("/sys/fs/cgroup/devices/devices.allow").exists() {
        let cgroups = std::fs::read_to_string(format!("/proc/{}/cgroup", st.pid)).unwrap();
        let path = cgroups
            .lines()
            .find_map(|l| l.split_once(":devices:").map(|x| x.1.to_string()))
            .unwrap_or_default();
        assert!(
            path.len() > 1,
            "init is not in a devices cgroup of its own: {cgroups}"
        );
        let list =
            std::fs::read_to_string(format!("/sys/fs/cgroup/devices{path}/devices.list")).unwrap();
        let mut got: Vec<&str> = list.lines().collect();
        got.sort();
        let mut want = cubelet::cgroup::DEVICE_ALLOW.to_vec();
        want.sort();
        assert_eq!(got, want, "devices cgroup {path}");
    }

    // Pause: a busy loop stops making progress while frozen, and resumes after.
    sh(
        &sb,
        "(while true; do echo x >> /tmp/c; sleep 0.02; done) >/dev/null 2>&1 &",
    )
    .await;
    // Paused once the loop is seen running.
    let t = std::time::Instant::now();
    while file_len(st.pid, "/tmp/c") == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the loop never wrote"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let paused = cl
        .pause_sandbox(pb::PauseSandboxRequest {
            sandbox_id: "life1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.state, pb::SandboxState::Paused as i32);
    let a = file_len(st.pid, "/tmp/c");
    assert!(a > 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        file_len(st.pid, "/tmp/c"),
        a,
        "a frozen sandbox kept running"
    );
    let e = cl
        .pause_sandbox(pb::PauseSandboxRequest {
            sandbox_id: "life1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    cl.resume_sandbox(pb::ResumeSandboxRequest {
        sandbox_id: "life1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let t = std::time::Instant::now();
    while file_len(st.pid, "/tmp/c") <= a {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "resumed sandbox does not run"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (code, _) = sh(&sb, "true").await;
    assert_eq!(code, 0);

    // Get and List.
    let g = cl
        .get_sandbox(pb::SandboxRef {
            sandbox_id: "life1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.sandbox_id, "life1");
    let l = cl
        .list_sandboxes(pb::ListSandboxesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(l.sandboxes.len(), 1);

    // Snapshot (filesystem only) into a new template, and a sandbox from it sees the file.
    let snap = cl
        .snapshot_sandbox(pb::SnapshotSandboxRequest {
            sandbox_id: "life1".into(),
            template: "snap1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(snap.filesystem_only);
    let mut r = create_req("fromsnap");
    r.template = "snap1".into();
    // A snapshot is refused unless the master pinned the create to it (its owner team's),
    // and a plain template is refused as a snapshot.
    let e = cl.create_sandbox(r.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let mut plain = create_req("notsnap");
    plain.from_snapshot = true;
    let e = cl.create_sandbox(plain).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    r.from_snapshot = true;
    let sb2 = cl.create_sandbox(r).await.unwrap().into_inner();
    let (_, out) = sh(&sb2, "cat /home/user/f.txt").await;
    assert_eq!(out, "hello\n");
    // The template is in use: deleting it is refused.
    let e = cl
        .delete_template(pb::DeleteTemplateRequest {
            name: "snap1".into(),
            build: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // Kill releases everything.
    assert!(
        cl.kill_sandbox(pb::SandboxRef {
            sandbox_id: "life1".into()
        })
        .await
        .unwrap()
        .into_inner()
        .existed
    );
    assert!(
        cl.kill_sandbox(pb::SandboxRef {
            sandbox_id: "fromsnap".into()
        })
        .await
        .unwrap()
        .into_inner()
        .existed
    );
    assert!(
        !cl.kill_sandbox(pb::SandboxRef {
            sandbox_id: "life1".into()
        })
        .await
        .unwrap()
        .into_inner()
        .existed
    );
    assert!(!cubelet::runtime::is_alive(st.pid, st.pid_start));
    c.assert_clean();
    assert_eq!(
        cl.delete_template(pb::DeleteTemplateRequest {
            name: "snap1".into(),
            build: String::new()
        })
        .await
        .unwrap()
        .into_inner()
        .builds_deleted,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_grpc_errors() {
    cube_testkit::require_priv!("cubelet::bad_requests");
    let mut c = Cubelet::new(
        "err",
        Opts {
            max_sandboxes: 1,
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let cases: Vec<(pb::CreateSandboxRequest, Code, &str)> = vec![
        (
            {
                let mut r = create_req("a1");
                r.template = "Bad/Name".into();
                r
            },
            Code::InvalidArgument,
            "invalid template name",
        ),
        (
            {
                let mut r = create_req("a1");
                r.template = "nosuch".into();
                r
            },
            Code::NotFound,
            "not found",
        ),
        (
            {
                let mut r = create_req("a1");
                r.build = "zz".into();
                r
            },
            Code::InvalidArgument,
            "invalid build",
        ),
        (
            {
                let mut r = create_req("a1");
                r.build = "0123456789abcdef".into();
                r
            },
            Code::NotFound,
            "no build",
        ),
        (
            create_req("Bad-Id"),
            Code::InvalidArgument,
            "invalid sandbox id",
        ),
        (
            {
                let mut r = create_req("a1");
                r.shape = Some(pb::Shape {
                    vcpus: 1000,
                    memory_mib: 256,
                    disk_mib: 0,
                });
                r
            },
            Code::InvalidArgument,
            "vCPUs",
        ),
        (
            {
                let mut r = create_req("a1");
                r.shape = Some(pb::Shape {
                    vcpus: 1,
                    memory_mib: 1,
                    disk_mib: 0,
                });
                r
            },
            Code::InvalidArgument,
            "memory",
        ),
        (
            {
                let mut r = create_req("a1");
                r.shape = Some(pb::Shape {
                    vcpus: 1,
                    memory_mib: 256,
                    disk_mib: 1,
                });
                r
            },
            Code::InvalidArgument,
            "disk",
        ),
        (
            {
                let mut r = create_req("a1");
                r.network = Some(pb::NetworkPolicy {
                    internet: false,
                    allow_cidrs: vec!["nonsense".into()],
                    ..Default::default()
                });
                r
            },
            Code::InvalidArgument,
            "CIDR",
        ),
    ];
    for (req, code, msg) in cases {
        let e = cl.create_sandbox(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert!(
            e.message().contains(msg),
            "{:?} does not mention {msg:?}",
            e.message()
        );
    }
    let first = cl
        .create_sandbox(create_req("a1"))
        .await
        .unwrap()
        .into_inner();
    // A resent create (the master lost the reply) answers with the sandbox it made, even on a
    // full node; the same id in another state is refused.
    let again = cl
        .create_sandbox(create_req("a1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (&again.agent_address, again.created_at_ms),
        (&first.agent_address, first.created_at_ms),
        "a resent create made another sandbox"
    );
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "a1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let e = cl.create_sandbox(create_req("a1")).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    cl.resume_sandbox(pb::ResumeSandboxRequest {
        sandbox_id: "a1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let e = cl.create_sandbox(create_req("a2")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    for e in [
        cl.get_sandbox(pb::SandboxRef {
            sandbox_id: "nope".into(),
        })
        .await
        .unwrap_err(),
        cl.pause_sandbox(pb::PauseSandboxRequest {
            sandbox_id: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err(),
        cl.resume_sandbox(pb::ResumeSandboxRequest {
            sandbox_id: "nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::NotFound);
    }
    let e = cl
        .resume_sandbox(pb::ResumeSandboxRequest {
            sandbox_id: "a1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let e = cl
        .import_template(pb::ImportTemplateRequest {
            name: "x".into(),
            source: None,
            extra_mib: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = cl
        .import_template(pb::ImportTemplateRequest {
            name: "x".into(),
            source: Some(pb::import_template_request::Source::Directory(
                "/nonexistent".into(),
            )),
            extra_mib: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = cl
        .delete_template(pb::DeleteTemplateRequest {
            name: "nosuch".into(),
            build: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "a1".into(),
    })
    .await
    .unwrap();
    c.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_cubelet_readopts_running_and_reaps_half_created() {
    cube_testkit::require_priv!("cubelet::restart_readopts");
    restart_readopts("namespace").await;
}

/// The same on gVisor: runsc sandboxes outlive cubelet and are taken back (runsc knows them
/// with the recorded pid), a half-created one is reaped with its bundle and root mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_cubelet_readopts_gvisor_sandboxes() {
    cube_testkit::require_priv!("cubelet::restart_readopts_gvisor");
    restart_readopts("gvisor").await;
}

/// A gVisor cubelet whose pauses go to disk (`[gvisor] pause_to_disk`).
fn gvisor_pausing_to_disk(name: &str) -> Cubelet {
    Cubelet::new(
        name,
        Opts {
            runtime: Some("gvisor"),
            network_pool: 1,
            gvisor_pause_to_disk: true,
            ..Default::default()
        },
    )
}

/// `[gvisor] pause_to_disk` (opt-in): a pause is a `runsc checkpoint` that stops the sandbox,
/// so nothing of it runs; it is re-adopted by a restarted cubelet from its image, and a resume
/// restores it with its memory. Debian's runsc restores about one checkpoint in ten with the
/// agent wedged (gVisor #13920, #14147): such a resume must fail cleanly, the sandbox still
/// paused with its image, and be killable without leftovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_pause_to_disk_stops_the_sandbox_and_survives_a_restart() {
    cube_testkit::require_priv!("cubelet::gvisor_pause_to_disk");
    let mut c = gvisor_pausing_to_disk("gpd");
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("disk1"))
        .await
        .unwrap()
        .into_inner();
    // Only in the Sentry's memory (its /tmp).
    sh(&sb, "echo kept > /tmp/m").await;
    let running = state_of(&c, "disk1");
    assert!(cubelet::runtime::is_alive(running.pid, running.pid_start));
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "disk1".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let ps = state_of(&c, "disk1");
    let image = ps
        .runtime
        .paused_image()
        .expect("no pause image")
        .to_owned();
    assert!(image.join("checkpoint.img").is_file(), "{image:?}");
    // Nothing of it runs on the host.
    assert_eq!(ps.pid, 0);
    assert!(!cubelet::runtime::is_alive(running.pid, running.pid_start));
    let procs = ["", "memory/"].iter().find_map(|h| {
        std::fs::read_to_string(format!(
            "/sys/fs/cgroup/{h}{}/{}/cgroup.procs",
            c.cgroup_parent, ps.key
        ))
        .ok()
    });
    assert_eq!(procs.as_deref().map(str::trim), Some(""), "{procs:?}");
    // Re-adopted from its image by a restarted cubelet.
    c.crash();
    let mut cl = c.start().await;
    let g = cl
        .get_sandbox(pb::SandboxRef {
            sandbox_id: "disk1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.state, pb::SandboxState::Paused as i32, "{}", c.log());
    let r = cl
        .resume_sandbox(pb::ResumeSandboxRequest {
            sandbox_id: "disk1".into(),
            ..Default::default()
        })
        .await;
    match r {
        Ok(_) => {
            assert_eq!(sh(&sb, "cat /tmp/m").await.1, "kept\n");
            assert_eq!(state_of(&c, "disk1").runtime.paused_image(), None);
            assert!(!image.exists());
        }
        Err(e) => {
            // The gVisor bug: a clear error, still paused, the image kept.
            assert!(e.message().contains("did not answer"), "{e:?}");
            let st = state_of(&c, "disk1");
            assert_eq!((st.phase, st.pid), (cubelet::node::Phase::Paused, 0));
            assert!(image.join("checkpoint.img").is_file());
            eprintln!("the restore came back wedged (gVisor #13920/#14147): {e:?}");
        }
    }
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "disk1".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

/// Debian's runsc can save a checkpoint in which the epoll interest of the agent's listening
/// socket never reports again, when a connection arrives while the Sentry saves (gVisor
/// #14147): restored, such an agent completes TCP handshakes and never answers (on ptrace ~1
/// restore in 30 before the agent accepted on a blocking thread). Snapshots taken while
/// connections keep arriving, each restored into a new sandbox: every one answers, with the
/// memory saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_snapshots_taken_under_connections_restore_answering() {
    cube_testkit::require_priv!("cubelet::gvisor_restore_under_connections");
    let mut c = Cubelet::new(
        "grc",
        Opts {
            runtime: Some("gvisor"),
            network_pool: 1,
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("csrc"))
        .await
        .unwrap()
        .into_inner();
    sh(&sb, "echo kept > /tmp/m").await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let knockers: Vec<_> = (0..3)
        .map(|_| {
            let (stop, agent) = (stop.clone(), agent_for(&sb));
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = agent.wait_healthy(Duration::from_millis(300)).await;
                }
            })
        })
        .collect();
    for i in 0..12 {
        let template = format!("csnap{i}");
        cl.snapshot_sandbox(pb::SnapshotSandboxRequest {
            sandbox_id: "csrc".into(),
            template: template.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("snapshot {i}: {e:?}"));
        let id = format!("cclone{i}");
        let mut r = create_req(&id);
        r.template = template.clone();
        r.from_snapshot = true;
        r.ready_timeout_ms = 5000;
        let clone = cl
            .create_sandbox(r)
            .await
            .unwrap_or_else(|e| panic!("restore {i} did not answer: {e:?}"))
            .into_inner();
        assert_eq!(sh(&clone, "cat /tmp/m").await.1, "kept\n", "restore {i}");
        cl.kill_sandbox(pb::SandboxRef { sandbox_id: id })
            .await
            .unwrap();
        cl.delete_template(pb::DeleteTemplateRequest {
            name: template,
            build: String::new(),
        })
        .await
        .unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for k in knockers {
        k.await.unwrap();
    }
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "csrc".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

async fn restart_readopts(runtime: &'static str) {
    let mut c = Cubelet::new(
        if runtime == "gvisor" { "rsg" } else { "rst" },
        Opts {
            runtime: Some(runtime),
            network_pool: 2,
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("keep1"))
        .await
        .unwrap()
        .into_inner();
    let paused = cl
        .create_sandbox(create_req("keep2"))
        .await
        .unwrap()
        .into_inner();
    // On gVisor, /tmp is the Sentry's tmpfs: only memory holds it.
    sh(&paused, "echo in-memory > /tmp/m").await;
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "keep2".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // Paused without memory: its processes end, its disk stays; it restarts on resume.
    let fresh = cl
        .create_sandbox(create_req("keep3"))
        .await
        .unwrap()
        .into_inner();
    sh(
        &fresh,
        "echo in-memory > /tmp/m; echo on-disk > ~/f; sleep 600 &",
    )
    .await;
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "keep3".into(),
        filesystem_only: true,
    })
    .await
    .unwrap();
    let fs = state_of(&c, "keep3");
    assert!(fs.stopped && fs.pid == 0, "{fs:?}");
    assert!(fs.runtime.paused_image().is_none());
    sh(&sb, "echo before > /tmp/x").await;
    let st = state_of(&c, "keep1");
    // The sampler (every 500 ms here) samples, pulls the agent's log and writes the journal.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let crashed_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    c.crash();
    // The sandbox outlives its cubelet.
    assert!(cubelet::runtime::is_alive(st.pid, st.pid_start));
    // A half-created sandbox (crash during create) and a corrupt state file.
    let half = c.data().join("sandboxes/half1");
    std::fs::create_dir_all(&half).unwrap();
    let mut hs = st.clone();
    hs.id = "half1".into();
    hs.key = "deadbeef0001".into();
    hs.phase = cubelet::node::Phase::Creating;
    hs.pid = 0;
    hs.endpoint = None;
    cubelet::state::write(
        &half.join("state.json"),
        cubelet::node::STATE_MAGIC,
        cubelet::node::STATE_VERSION,
        &hs,
    )
    .unwrap();
    std::fs::write(half.join("disk.ext4"), b"x").unwrap();
    let bad = c.data().join("sandboxes/corrupt1");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("state.json"), b"{\"magic\":").unwrap();

    let mut cl = c.start().await;
    let l = cl
        .list_sandboxes(pb::ListSandboxesRequest {})
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<&str> = l.sandboxes.iter().map(|s| s.sandbox_id.as_str()).collect();
    assert_eq!(ids, vec!["keep1", "keep2", "keep3"], "{}", c.log());
    assert!(l.sandboxes.iter().all(|s| s.runtime == runtime), "{l:?}");
    assert!(
        !half.exists() && !bad.exists(),
        "half-created sandboxes were not reaped"
    );
    let (_, out) = sh(&sb, "cat /tmp/x").await;
    assert_eq!(out, "before\n");
    // The history from before the crash is still there, and the log goes on.
    let before = cl
        .sandbox_metrics(pb::SandboxMetricsRequest {
            sandbox_id: "keep1".into(),
            start_ms: 0,
            end_ms: crashed_ms,
        })
        .await
        .unwrap()
        .into_inner()
        .samples;
    assert!(!before.is_empty(), "no samples from before the crash");
    let log = |cl: &mut pb::node_client::NodeClient<tonic::transport::Channel>| {
        let mut cl = cl.clone();
        async move {
            cl.sandbox_logs(pb::SandboxLogsRequest {
                sandbox_id: "keep1".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .entries
            .into_iter()
            .map(|e| {
                format!(
                    "{} {}",
                    e.message,
                    e.fields.get("cmd").cloned().unwrap_or_default()
                )
            })
            .collect::<Vec<String>>()
        }
    };
    let msgs = log(&mut cl).await;
    let at = |m: &[String], what: &str| m.iter().position(|x| x.contains(what));
    let created = at(&msgs, "Sandbox created").unwrap_or_else(|| panic!("{msgs:?}"));
    let readopted = at(&msgs, "re-adopted").unwrap_or_else(|| panic!("{msgs:?}"));
    assert!(created < readopted, "{msgs:?}");
    assert!(
        msgs[..readopted].iter().any(|m| m.contains("echo before")),
        "the agent's log from before the crash: {msgs:?}"
    );
    let g = cl
        .get_sandbox(pb::SandboxRef {
            sandbox_id: "keep2".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.state, pb::SandboxState::Paused as i32);
    cl.resume_sandbox(pb::ResumeSandboxRequest {
        sandbox_id: "keep2".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(sh(&paused, "echo ok").await.1, "ok\n");
    assert_eq!(sh(&paused, "cat /tmp/m").await.1, "in-memory\n");
    // Started afresh from its disk, initialised as at its create (its env var is back).
    cl.resume_sandbox(pb::ResumeSandboxRequest {
        sandbox_id: "keep3".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let (_, out) = sh(
        &fresh,
        "cat ~/f; cat /tmp/m 2>/dev/null || echo no-tmp; echo $FOO",
    )
    .await;
    assert_eq!(out, "on-disk\nno-tmp\nbar\n");
    assert!(!state_of(&c, "keep3").stopped);
    // A full pause resumed with a reboot restarts too: its memory is dropped.
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "keep2".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    cl.resume_sandbox(pb::ResumeSandboxRequest {
        sandbox_id: "keep2".into(),
        reboot: true,
    })
    .await
    .unwrap();
    let (_, out) = sh(&paused, "cat /tmp/m 2>/dev/null || echo no-tmp").await;
    assert_eq!(out, "no-tmp\n");
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "keep1".into(),
    })
    .await
    .unwrap();
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "keep2".into(),
    })
    .await
    .unwrap();
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "keep3".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templates_and_node_status_over_grpc() {
    cube_testkit::require_priv!("cubelet::templates_and_node_status");
    let mut c = Cubelet::new("tpl", Opts::default());
    let mut cl = c.start().await;
    let st = cl
        .node_status(pb::NodeStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.runtime, "namespace");
    assert!(["none", "pvm", "hardware"].contains(&st.kvm_kind.as_str()));
    assert!(st.capacity.unwrap().memory_mib > 0);
    assert_eq!(st.templates, vec!["mini"]);
    // OCI layout import, content addressed: the second import is reused.
    let layout = c.staging().join("oci");
    let host = c.root.join("hostroot");
    let sh_bytes = std::fs::read(host.join("bin/sh")).unwrap();
    cubelet::oci::write_test_layout(
        &layout,
        &[
            vec![("etc/os", b"oci\n")],
            vec![("etc/.wh.os", b""), ("etc/os2", b"two\n")],
        ],
        &serde_json::json!({"config": {"Env": ["X=1"], "Cmd": ["/bin/sh"]}}),
    )
    .unwrap();
    drop(sh_bytes);
    let req = pb::ImportTemplateRequest {
        name: "ocit".into(),
        source: Some(pb::import_template_request::Source::OciPath(
            layout.display().to_string(),
        )),
        extra_mib: 0,
    };
    let t1 = cl.import_template(req.clone()).await.unwrap().into_inner();
    assert_eq!(t1.source, "oci");
    assert_eq!(t1.env, vec!["X=1"]);
    assert!(!t1.reused);
    let t2 = cl.import_template(req).await.unwrap().into_inner();
    assert!(t2.reused);
    assert_eq!(t1.build, t2.build);
    let l = cl
        .list_templates(pb::ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = l.templates.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, vec!["mini", "ocit"]);
    assert_eq!(
        cl.delete_template(pb::DeleteTemplateRequest {
            name: "ocit".into(),
            build: String::new()
        })
        .await
        .unwrap()
        .into_inner()
        .builds_deleted,
        1
    );
    // Metrics endpoint.
    let body = http_get(&c.http, "/metrics").await;
    assert!(body.contains("cube_pool_ready"), "{body}");
}

async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut b = String::new();
    s.read_to_string(&mut b).await.unwrap();
    b
}

/// Ready sandboxes in the node's started pool.
fn started_ready(st: &pb::NodeStatusResponse) -> u32 {
    st.pools
        .iter()
        .find(|p| p.pool == "started")
        .map(|p| p.ready)
        .unwrap_or(0)
}

/// Polls until the started pool holds `n` ready sandboxes (fails after `limit`).
async fn until_started(
    cl: &mut pb::node_client::NodeClient<tonic::transport::Channel>,
    n: u32,
    limit: Duration,
    c: &Cubelet,
) {
    let t = std::time::Instant::now();
    loop {
        let st = cl
            .node_status(pb::NodeStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if started_ready(&st) >= n {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "started pool did not reach {n}: {:?}\n{}",
            st.pools,
            c.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_serve_creates_and_churn_leaves_nothing() {
    cube_testkit::require_priv!("cubelet::pools_churn");
    let n: usize = std::env::var("CUBE_CHURN_COUNT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let mut c = Cubelet::new(
        "churn",
        Opts {
            network_pool: 8,
            disk_pool: 4,
            started: 2,
            refill_delay_ms: Some(1500),
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    until_started(&mut cl, 2, Duration::from_secs(60), &c).await;
    let sb = cl
        .create_sandbox(create_req("pooled1"))
        .await
        .unwrap()
        .into_inner();
    assert!(sb.from_pool);
    // The replacement waits `refill_delay_ms` (the 50 ms refill interval does not start it
    // early), then comes.
    let taken = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = cl
        .node_status(pb::NodeStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        started_ready(&st),
        1,
        "refilled during the delay: {:?}",
        st.pools
    );
    until_started(&mut cl, 2, Duration::from_secs(30), &c).await;
    assert!(taken.elapsed() >= Duration::from_millis(1500));
    assert_eq!(
        sh(&sb, "echo $FOO").await.1,
        "bar\n",
        "pooled sandbox did not get its /init env"
    );
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "pooled1".into(),
    })
    .await
    .unwrap();
    let start = std::time::Instant::now();
    let mut pooled = 0;
    for i in 0..n {
        let id = format!("churn{i}");
        let sb = cl
            .create_sandbox(create_req(&id))
            .await
            .unwrap_or_else(|e| panic!("create {id}: {e:?}\n{}", c.log()))
            .into_inner();
        pooled += usize::from(sb.from_pool);
        cl.kill_sandbox(pb::SandboxRef { sandbox_id: id })
            .await
            .unwrap();
    }
    eprintln!(
        "{n} create+kill in {:?} ({pooled} from the started pool)",
        start.elapsed()
    );
    let body = http_get(&c.http, "/metrics").await;
    assert!(
        body.contains("cube_pool_ready{pool=\"started\",template=\"mini\"}"),
        "{body}"
    );
    c.stop();
    c.assert_clean();
}

/// The node's backstop: a running sandbox whose end time (the master's, by create and
/// SetEndTime) is `end_grace_s` past is ended by the node itself; one whose end is ahead, and
/// a paused one (its retention is the master's), are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_ends_sandboxes_their_master_left_past_their_end() {
    cube_testkit::require_priv!("cubelet::end_overdue");
    let mut c = Cubelet::new(
        "endt",
        Opts {
            end_grace_s: Some(1),
            network_pool: 2,
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut ids = Vec::new();
    for id in ["end1", "end2", "end3"] {
        let mut r = create_req(id);
        r.end_at_ms = now + 600_000;
        let sb = cl.create_sandbox(r).await.unwrap().into_inner();
        assert_eq!(sb.end_at_ms, now + 600_000);
        ids.push(sb);
    }
    // With `timeout_ms`, the end counts from when the sandbox is ready (end_at_ms ignored).
    let mut r = create_req("end4");
    r.end_at_ms = 1;
    r.timeout_ms = 600_000;
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let sb = cl.create_sandbox(r).await.unwrap().into_inner();
    let after = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        (before + 600_000..=after + 600_000).contains(&sb.end_at_ms),
        "{} not in [{}, {}]",
        sb.end_at_ms,
        before + 600_000,
        after + 600_000
    );
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "end4".into(),
    })
    .await
    .unwrap();
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "end3".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    // The master moves two ends into the past (as a shortened timeout would), the one that
    // stays running past its grace is ended.
    for id in ["end1", "end3"] {
        let sb = cl
            .set_end_time(pb::SetEndTimeRequest {
                sandbox_id: id.into(),
                end_at_ms: now - 5_000,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(sb.end_at_ms, now - 5_000);
    }
    assert_eq!(state_of(&c, "end1").end_at_ms, now - 5_000, "not recorded");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let l = cl
            .list_sandboxes(pb::ListSandboxesRequest {})
            .await
            .unwrap()
            .into_inner();
        let mut left: Vec<&str> = l.sandboxes.iter().map(|s| s.sandbox_id.as_str()).collect();
        left.sort();
        if left == ["end2", "end3"] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "left: {left:?}\n{}",
            c.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(sh(&ids[1], "echo alive").await.1, "alive\n");
    let ended = cl
        .sandbox_logs(pb::SandboxLogsRequest {
            sandbox_id: "end1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert!(
        ended
            .iter()
            .any(|e| e.message.contains("ended by its node")),
        "{ended:?}"
    );
    // An unknown sandbox is a clear error.
    let e = cl
        .set_end_time(pb::SetEndTimeRequest {
            sandbox_id: "nope1".into(),
            end_at_ms: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    for id in ["end2", "end3"] {
        cl.kill_sandbox(pb::SandboxRef {
            sandbox_id: id.into(),
        })
        .await
        .unwrap();
    }
    c.stop();
    c.assert_clean();
}

/// A killed sandbox's network endpoint is reused by the next create: same namespace and host
/// interface, no binding of the old sandbox left on it, and the new sandbox is reachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sandboxes_endpoints_are_recycled_clean() {
    cube_testkit::require_priv!("cubelet::endpoint_recycle");
    let mut c = Cubelet::new(
        "recyc",
        Opts {
            network_recycle: Some(4),
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let a = cl
        .create_sandbox(create_req("rec1"))
        .await
        .unwrap()
        .into_inner();
    let a_state = state_of(&c, "rec1");
    let a_ep = a_state.endpoint.clone().expect("endpoint");
    assert!(a_state.host_addr.is_some());
    assert_eq!(sh(&a, "echo one").await.1, "one\n");
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "rec1".into(),
    })
    .await
    .unwrap();
    // Kept: its namespace, attached to the switch but unbound (no address, policy or flows).
    assert!(a_ep.netns_path.exists(), "recycled namespace was deleted");
    let left = c.switch_has_port(a_ep.host_ifindex);
    assert!(
        left.iter()
            .all(|l| l.contains("cvs_ports") || l.contains("cvs_stats")),
        "old binding left on a recycled port: {left:?}"
    );
    let b = cl
        .create_sandbox(create_req("rec2"))
        .await
        .unwrap()
        .into_inner();
    let b_state = state_of(&c, "rec2");
    let b_ep = b_state.endpoint.clone().expect("endpoint");
    assert_eq!(b_ep.netns_path, a_ep.netns_path, "endpoint was not reused");
    assert_eq!(b.host_interface, a.host_interface);
    // Reachable at its (possibly new) address, and it is a fresh sandbox.
    assert_eq!(
        sh(&b, "echo two; ls /proc | grep -c '^[0-9]'")
            .await
            .1
            .lines()
            .next(),
        Some("two")
    );
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "rec2".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

/// A pooled endpoint whose namespace went away while it waited (the run directory cleaned under
/// a running node, as `cubectl down` of a node it did not stop does) is never handed out: the
/// create gets a whole endpoint, the broken one is deleted and counted, and a run directory
/// removed outright is made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_endpoints_without_their_namespace_are_not_handed_out() {
    cube_testkit::require_priv!("cubelet::pool_validates_netns");
    let mut c = Cubelet::new(
        "nsval",
        Opts {
            network_recycle: Some(4),
            ..Default::default()
        },
    );
    let mut cl = c.start().await;
    let unmount = |p: &std::path::Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid C string; detaching a test's own namespace mount.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    };
    let mut broken: Vec<cubelet::network::Endpoint> = Vec::new();
    for (i, whole_dir) in [(1, false), (2, true)] {
        let id = format!("nsv{i}");
        cl.create_sandbox(create_req(&id)).await.unwrap();
        let ep = state_of(&c, &id).endpoint.expect("endpoint");
        assert!(
            broken.iter().all(|b| b.netns_path != ep.netns_path),
            "a broken endpoint was handed out"
        );
        cl.kill_sandbox(pb::SandboxRef { sandbox_id: id })
            .await
            .unwrap();
        assert!(ep.netns_path.exists(), "the endpoint was not recycled");
        unmount(&ep.netns_path);
        if whole_dir {
            let dir = ep.netns_path.parent().unwrap();
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                unmount(&e.path());
            }
            std::fs::remove_dir_all(dir).unwrap();
        } else {
            std::fs::remove_file(&ep.netns_path).unwrap();
        }
        broken.push(ep);
    }
    let sb = cl
        .create_sandbox(create_req("nsv3"))
        .await
        .unwrap_or_else(|e| panic!("create after the run directory went: {e:?}\n{}", c.log()))
        .into_inner();
    let ep = state_of(&c, "nsv3").endpoint.expect("endpoint");
    assert!(broken.iter().all(|b| b.netns_path != ep.netns_path));
    assert_eq!(sh(&sb, "echo ok").await.1, "ok\n");
    // Both broken endpoints were deleted (their host links too) and counted.
    for gone in &broken {
        let name = std::ffi::CString::new(gone.host_if.as_str()).unwrap();
        // SAFETY: valid C string.
        assert_eq!(
            unsafe { libc::if_nametoindex(name.as_ptr()) },
            0,
            "{} left",
            gone.host_if
        );
    }
    let body = http_get(&c.http, "/metrics").await;
    assert!(
        body.contains("cube_sandbox_operations_total{op=\"pool_endpoint\",result=\"discarded\"} 2"),
        "{body}"
    );
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "nsv3".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

/// The node's data disk full (its XFS filled by a file outside any sandbox): creates and
/// filesystem-only pauses either work or fail with an error that says so, a running sandbox
/// keeps running and keeps what it had, nothing is left half-made, and once space is back the
/// node creates again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_data_disk_fails_clearly_and_keeps_running_sandboxes() {
    cube_testkit::require_priv!("cubelet::disk_full");
    let mut c = Cubelet::new("dfull", Opts::default());
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("df1"))
        .await
        .unwrap()
        .into_inner();
    let (code, out) = sh(
        &sb,
        "echo before > $HOME/kept && sync && cat $HOME/kept 2>&1",
    )
    .await;
    assert_eq!(out, "before\n", "exit {code}");
    // A template to import later, staged while there is room.
    let layout = c.staging().join("oci-full");
    cubelet::oci::write_test_layout(
        &layout,
        &[vec![("etc/os", b"oci\n")]],
        &serde_json::json!({"config": {"Cmd": ["/bin/sh"]}}),
    )
    .unwrap();
    let import = pb::ImportTemplateRequest {
        name: "fulltpl".into(),
        source: Some(pb::import_template_request::Source::OciPath(
            layout.display().to_string(),
        )),
        extra_mib: 0,
    };
    let filler = fill_disk(&c.data(), 0);
    let mut made = Vec::new();
    for i in 0..3 {
        let id = format!("dfx{i}");
        match cl.create_sandbox(create_req(&id)).await {
            Ok(s) => made.push(s.into_inner()),
            Err(e) => {
                eprintln!("create on a full disk: {:?}: {}", e.code(), e.message());
                let m = e.message().to_lowercase();
                assert!(
                    m.contains("no space") || m.contains("disk") && m.contains("full"),
                    "a create on a full disk failed without saying why: {e:?}"
                );
                assert!(
                    !c.data().join("sandboxes").join(&id).exists(),
                    "a failed create left its directory"
                );
            }
        }
    }
    eprintln!("creates on a full disk: {} of 3 made", made.len());
    // A template build on a full disk fails saying so, and registers nothing.
    let e = cl.import_template(import.clone()).await.unwrap_err();
    eprintln!(
        "template import on a full disk: {:?}: {}",
        e.code(),
        e.message()
    );
    assert!(
        e.message().to_lowercase().contains("no space"),
        "a template build on a full disk failed without saying why: {e:?}"
    );
    let names = |l: pb::ListTemplatesResponse| -> Vec<String> {
        l.templates.into_iter().map(|t| t.name).collect()
    };
    let l = cl
        .list_templates(pb::ListTemplatesRequest {})
        .await
        .unwrap();
    assert_eq!(names(l.into_inner()), vec!["mini"]);
    // The running sandbox keeps running and keeps its file (writes may fail: the disk is full).
    assert_eq!(sh(&sb, "cat $HOME/kept").await.1, "before\n");
    let (code, out) = sh(&sb, "echo x > $HOME/new 2>&1; sync; echo rc=$?").await;
    eprintln!("a write inside on a full disk: code {code}, {out:?}");
    assert_eq!(sh(&sb, "echo alive").await.1, "alive\n");
    // Space back: creates work again, and everything goes cleanly.
    std::fs::remove_file(&filler).unwrap();
    let again = cl
        .create_sandbox(create_req("df2"))
        .await
        .unwrap_or_else(|e| panic!("create after space came back: {e:?}\n{}", c.log()))
        .into_inner();
    assert_eq!(sh(&again, "echo ok").await.1, "ok\n");
    // And the same template build now goes through.
    cl.import_template(import).await.unwrap();
    let l = cl
        .list_templates(pb::ListTemplatesRequest {})
        .await
        .unwrap();
    assert_eq!(names(l.into_inner()), vec!["fulltpl", "mini"]);
    for id in ["df1", "df2"]
        .into_iter()
        .map(String::from)
        .chain(made.iter().map(|s| s.sandbox_id.clone()))
    {
        cl.kill_sandbox(pb::SandboxRef { sandbox_id: id })
            .await
            .unwrap();
    }
    c.stop();
    c.assert_clean();
}

/// Fills the filesystem holding `dir` with a file in it, until no more than `leave` bytes are
/// free (0: not even a block fits, what a full node disk looks like); returns the file, whose
/// removal gives the space back.
fn fill_disk(dir: &std::path::Path, leave: u64) -> std::path::PathBuf {
    let filler = dir.join("filler");
    let c_path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid C string and a local out-buffer.
    let mut fs: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c_path.as_ptr(), &mut fs) }, 0);
    let free = (fs.f_bavail * fs.f_frsize).saturating_sub(leave);
    // Extend the filler by halving chunks until not even a block fits.
    let f = std::fs::File::create(&filler).unwrap();
    let (mut len, mut chunk) = (0i64, free as i64);
    while chunk >= 4096 && len < free as i64 {
        chunk = chunk.min(free as i64 - len);
        // SAFETY: fallocate on a file we own.
        let r = unsafe {
            use std::os::fd::AsRawFd;
            libc::fallocate(f.as_raw_fd(), 0, len, chunk)
        };
        if r == 0 {
            len += chunk;
        } else {
            chunk /= 2;
        }
    }
    assert!(len > 0);
    filler
}

/// `[gvisor] pause_to_disk` with the node's disk full: the checkpoint cannot be written, so
/// the pause fails saying why, leaves no partial image, and the sandbox keeps running with its
/// memory; once space is back the same pause goes through and the resume brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_pause_to_disk_on_a_full_disk_fails_clearly_and_keeps_running() {
    cube_testkit::require_priv!("cubelet::gvisor_pause_disk_full");
    let mut c = gvisor_pausing_to_disk("gpf");
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("pf1"))
        .await
        .unwrap()
        .into_inner();
    // Only in the Sentry's memory (its /tmp), and more of it than a few blocks.
    sh(
        &sb,
        "echo kept > /tmp/m; head -c 8000000 /dev/urandom > /tmp/big",
    )
    .await;
    let running = state_of(&c, "pf1");
    // Room for the image's directory and a start of it, not for the sandbox's memory.
    let filler = fill_disk(&c.data(), 4 << 20);
    let e = cl
        .pause_sandbox(pb::PauseSandboxRequest {
            sandbox_id: "pf1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    eprintln!(
        "pause to disk on a full disk: {:?}: {}",
        e.code(),
        e.message()
    );
    assert!(
        e.message().to_lowercase().contains("no space"),
        "a pause to disk on a full disk failed without saying why: {e:?}"
    );
    // Still running, with its memory, and no half-written image left.
    let st = state_of(&c, "pf1");
    assert_eq!(st.phase, cubelet::node::Phase::Running);
    assert_eq!(st.runtime.paused_image(), None);
    assert_eq!((st.pid, st.pid_start), (running.pid, running.pid_start));
    assert!(cubelet::runtime::is_alive(st.pid, st.pid_start));
    assert!(
        !c.data()
            .join("sandboxes")
            .join("pf1")
            .join("paused")
            .exists(),
        "a failed pause left its image"
    );
    assert_eq!(sh(&sb, "cat /tmp/m").await.1, "kept\n");
    let g = cl
        .get_sandbox(pb::SandboxRef {
            sandbox_id: "pf1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.state, pb::SandboxState::Running as i32);
    // Space back: the pause and the resume work.
    std::fs::remove_file(&filler).unwrap();
    cl.pause_sandbox(pb::PauseSandboxRequest {
        sandbox_id: "pf1".into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("pause after space came back: {e:?}\n{}", c.log()));
    assert!(state_of(&c, "pf1").runtime.paused_image().is_some());
    match cl
        .resume_sandbox(pb::ResumeSandboxRequest {
            sandbox_id: "pf1".into(),
            ..Default::default()
        })
        .await
    {
        Ok(_) => assert_eq!(sh(&sb, "cat /tmp/m").await.1, "kept\n"),
        // Debian's runsc restores some checkpoints wedged (see the test above).
        Err(e) => assert!(e.message().contains("did not answer"), "{e:?}"),
    }
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "pf1".into(),
    })
    .await
    .unwrap();
    c.stop();
    c.assert_clean();
}

/// The default `base` template (bookworm minbase + bash, coreutils, python3, CA certificates)
/// built through debootstrap. The debootstrap root is cached in /var/cache/cube/templates keyed
/// by the recipe, so only the first run on a machine reaches Debian's mirror (~2 min).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_template_from_debootstrap_runs_python() {
    cube_testkit::require_priv!("cubelet::base_template");
    let mut c = Cubelet::new(
        "base",
        Opts {
            shared_cache: true,
            ..Default::default()
        },
    );
    c.cli(&["build-template", "base"]);
    let mut cl = c.start().await;
    let mut r = create_req("base1");
    r.template = "base".into();
    let sb = cl.create_sandbox(r).await.unwrap().into_inner();
    let (code, out) = sh(&sb, "python3 -c 'import ssl, os; print(os.getuid(), os.path.exists(\"/etc/ssl/certs/ca-certificates.crt\"))'; bash -c 'echo $BASH_VERSION' | cut -c1").await;
    assert_eq!(code, 0);
    assert_eq!(out, "1000 True\n5\n");
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "base1".into(),
    })
    .await
    .unwrap();
    c.assert_clean();
}
