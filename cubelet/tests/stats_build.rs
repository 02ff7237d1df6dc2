//! BuildTemplate streaming and SandboxStats against a real cubelet (namespace runtime).

mod common;

use common::*;
use cube_proto::nodev1 as pb;
use std::time::Duration;

async fn build_events(
    cl: &mut cube_proto::nodev1::node_client::NodeClient<tonic::transport::Channel>,
    req: pb::ImportTemplateRequest,
) -> Vec<pb::TemplateBuildEvent> {
    let mut s = cl.build_template(req).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(120), s.message())
        .await
        .expect("build stream stalled")
        .unwrap()
    {
        out.push(e);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn build_template_streams_progress_then_one_verdict() {
    cube_testkit::require_priv!("cubelet::build_template_streams");
    let mut c = Cubelet::new("bld", Opts::default());
    let mut cl = c.start().await;
    let dir = c
        .stage(&c.root.join("hostroot"), "hostroot")
        .display()
        .to_string();
    let req = pb::ImportTemplateRequest {
        name: "dirt".into(),
        source: Some(pb::import_template_request::Source::Directory(dir.clone())),
        extra_mib: 4,
    };
    let ev = build_events(&mut cl, req.clone()).await;
    let kinds: Vec<&str> = ev.iter().map(|e| e.kind.as_str()).collect();
    assert!(kinds.len() >= 3, "{kinds:?}");
    assert_eq!(kinds[0], "phase", "{kinds:?}");
    assert_eq!(*kinds.last().unwrap(), "done", "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| **k == "done").count(), 1);
    assert!(!kinds.contains(&"error"));
    assert!(ev
        .iter()
        .all(|e| ["phase", "progress", "done"].contains(&e.kind.as_str())));
    let t = ev
        .last()
        .unwrap()
        .template
        .clone()
        .expect("done carries the template");
    assert_eq!((t.name.as_str(), t.source.as_str()), ("dirt", "directory"));
    assert!(!t.reused && t.rootfs_bytes > 0);
    assert_eq!(ev.last().unwrap().done, t.rootfs_bytes);
    // The build is a real template: listed, and a sandbox runs from it.
    let names: Vec<String> = cl
        .list_templates(pb::ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(names.contains(&"dirt".to_string()), "{names:?}");
    // Same recipe again: reused, still one verdict.
    let ev2 = build_events(&mut cl, req).await;
    let last = ev2.last().unwrap();
    assert_eq!(last.kind, "done");
    let t2 = last.template.clone().unwrap();
    assert!(t2.reused);
    assert_eq!(t2.build, t.build);

    // Bad requests are refused before any stream starts.
    let link_out = c.staging().join("escape");
    std::os::unix::fs::symlink("/", &link_out).unwrap();
    let link_out = link_out.display().to_string();
    for (name, source) in [
        (
            "Bad Name",
            Some(pb::import_template_request::Source::Directory(dir.clone())),
        ),
        (
            "ok",
            Some(pb::import_template_request::Source::Directory(
                "/nonexistent/cube-dir".into(),
            )),
        ),
        ("ok", None),
        // Host paths outside the staging directory, directly or through a staged symlink.
        (
            "ok",
            Some(pb::import_template_request::Source::Directory(
                c.root.join("hostroot").display().to_string(),
            )),
        ),
        (
            "ok",
            Some(pb::import_template_request::Source::OciPath("/etc".into())),
        ),
        (
            "ok",
            Some(pb::import_template_request::Source::Directory(link_out)),
        ),
        (
            "ok",
            Some(pb::import_template_request::Source::Directory(format!(
                "{}/../hostroot",
                c.staging().display()
            ))),
        ),
    ] {
        let e = cl
            .build_template(pb::ImportTemplateRequest {
                name: name.into(),
                source,
                extra_mib: 0,
            })
            .await
            .err()
            .unwrap_or_else(|| panic!("{name}: accepted"));
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}: {e}");
    }
    // A failing build (a directory that is not a root filesystem: no room for the agent in a
    // read-only place is hard to arrange, so: a file where a directory is expected) ends in
    // one error event, not a broken stream.
    let not_dir = c.staging().join("plainfile");
    std::fs::write(&not_dir, b"x").unwrap();
    let ev3 = build_events(
        &mut cl,
        pb::ImportTemplateRequest {
            name: "broken".into(),
            source: Some(pb::import_template_request::Source::Directory(
                not_dir.display().to_string(),
            )),
            extra_mib: 0,
        },
    )
    .await;
    let last = ev3.last().unwrap();
    assert_eq!(last.kind, "error", "{ev3:?}");
    assert!(!last.message.is_empty());
    assert_eq!(
        ev3.iter()
            .filter(|e| e.kind == "error" || e.kind == "done")
            .count(),
        1
    );
    cl.delete_template(pb::DeleteTemplateRequest {
        name: "dirt".into(),
        build: String::new(),
    })
    .await
    .unwrap();
}

async fn stats(
    cl: &cube_proto::nodev1::node_client::NodeClient<tonic::transport::Channel>,
) -> pb::SandboxStatsResponse {
    cl.clone()
        .sandbox_stats(pb::SandboxRef {
            sandbox_id: "stats1".into(),
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_stats_of_a_real_sandbox() {
    cube_testkit::require_priv!("cubelet::sandbox_stats");
    let mut c = Cubelet::new("sts", Opts::default());
    let mut cl = c.start().await;
    let sb = cl
        .create_sandbox(create_req("stats1"))
        .await
        .unwrap()
        .into_inner();
    let s0 = stats(&cl).await;
    assert_eq!(s0.cpu_count, 1);
    // The cgroup limit is the shape's 256 MiB.
    assert_eq!(s0.mem_total_bytes, 256 << 20);
    assert!(s0.mem_used_bytes > 0 && s0.mem_used_bytes < s0.mem_total_bytes);
    assert!(s0.disk_total_bytes > 0 && s0.disk_used_bytes > 0);
    assert!(s0.disk_used_bytes <= s0.disk_total_bytes);
    assert!(s0.timestamp_ms > 0);

    // Busy for about a second: the next sample shows the CPU use of that interval.
    let (code, _) = sh(&sb, "i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done").await;
    assert_eq!(code, 0);
    let s1 = stats(&cl).await;
    assert!(s1.cpu_used_pct > 5.0, "busy interval: {}", s1.cpu_used_pct);
    assert!(s1.cpu_used_pct <= 100.0);
    // Idle: the interval since the previous sample shows (almost) nothing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s2 = stats(&cl).await;
    assert!(
        s2.cpu_used_pct < s1.cpu_used_pct,
        "{} vs {}",
        s2.cpu_used_pct,
        s1.cpu_used_pct
    );

    // 8 MiB written to the sandbox's disk show up in its disk use.
    let (code, _) = sh(&sb, "head -c 8388608 /dev/zero > /home/user/blob && sync").await;
    assert_eq!(code, 0);
    let s3 = stats(&cl).await;
    assert!(
        s3.disk_used_bytes >= s2.disk_used_bytes + (6 << 20),
        "{} → {}",
        s2.disk_used_bytes,
        s3.disk_used_bytes
    );
    assert_eq!(s3.disk_total_bytes, s2.disk_total_bytes);

    let e = cl
        .sandbox_stats(pb::SandboxRef {
            sandbox_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    let e = cl
        .sandbox_stats(pb::SandboxRef {
            sandbox_id: "../x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    cl.kill_sandbox(pb::SandboxRef {
        sandbox_id: "stats1".into(),
    })
    .await
    .unwrap();
    c.assert_clean();
}
