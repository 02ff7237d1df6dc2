//! Many shims restored from one template share its pages: each one's private memory is what
//! its guest wrote, not the template.

mod common;

use std::time::Duration;

use common::*;
use cube_hypervisor::{test_guests, Shape};
use cube_shim::protocol::{GuestStatus, Reply};
use cube_shim::Op;

#[test]
fn many_shims_from_one_snapshot_share_the_template_pages() {
    cube_testkit::require_kvm!("shim_many_share_pages");
    let n: usize = std::env::var("CUBE_SHIM_TEST_SHIMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let shape = Shape::new(1, 128);
    let ws: u64 = 16 << 20;
    let t = tmpdir("share");
    bench_template(t.path(), shape, ws);
    let shims: Vec<Shim> = (0..n).map(|_| Shim::spawn(shape)).collect();
    let mut clients: Vec<_> = shims.iter().map(|s| s.client()).collect();
    for c in clients.iter_mut() {
        assert!(matches!(restore(c, t.path()), Reply::Restored { .. }));
    }
    for c in clients.iter_mut() {
        let (_, guest, cps) = wait_guest(c, 30_000);
        assert_eq!(guest, GuestStatus::PausePoint { value: 3 });
        assert_eq!(cps, vec![2]);
        // Read the template's working set (one word per page), as a guest reading it would.
        let r = c
            .call(Op::Peek {
                gpa: test_guests::DATA_ADDR,
                count: (ws / 4096) as u32,
                stride: Some(4096),
            })
            .unwrap();
        let Reply::Values { values } = r else {
            panic!("{r:?}")
        };
        assert_eq!(values[1], 4096, "template contents visible");
    }
    std::thread::sleep(Duration::from_millis(50));
    let ws_kib = ws >> 10;
    let mut worst_pss = 0;
    let mut worst_private = 0;
    for c in clients.iter_mut() {
        let s = stats(c);
        assert!(s.guest_rss_kib >= ws_kib, "working set resident: {s:?}");
        worst_pss = worst_pss.max(s.guest_pss_kib);
        worst_private = worst_private.max(s.guest_private_kib);
    }
    eprintln!("{n} shims: worst guest PSS {worst_pss} KiB, worst guest private {worst_private} KiB (working set {ws_kib} KiB)");
    // Shared: each shim's proportional share is about ws / n, not ws.
    assert!(worst_pss < ws_kib / n as u64 + 1024, "PSS {worst_pss} KiB");
    assert!(worst_private < 1024, "private {worst_private} KiB");
    for s in shims {
        s.stop();
    }
}
