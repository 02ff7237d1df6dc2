//! Snapshot / restore on /dev/kvm: exact continuation, independence of many restores,
//! refusal of corrupt or mismatched snapshots, pause-to-disk resumed in a new process.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::*;
use cube_hypervisor::snapshot::MemoryRef;
use cube_hypervisor::{
    restore, restore_into, test_guests, Error, RunOutcome, Shape, Snapshot, SnapshotError,
    VcpuEvent, Vm, VmShell, Vmm,
};

fn devices(note: &str) -> BTreeMap<String, Vec<u8>> {
    let mut d = BTreeMap::new();
    d.insert("note".to_string(), note.as_bytes().to_vec());
    d
}

fn snapshot_kind(r: Result<impl Sized, Error>) -> SnapshotError {
    match r {
        Err(Error::Snapshot { kind, .. }) => kind,
        Err(e) => panic!("expected a snapshot error, got {e}"),
        Ok(_) => panic!("expected a snapshot error, got success"),
    }
}

#[test]
fn a_restored_guest_continues_exactly_where_it_was() {
    cube_testkit::require_kvm!("a_restored_guest_continues_exactly_where_it_was");
    let vmm = Vmm::new().unwrap();
    let dir = tmpdir("exact");
    let size = 512 << 10;
    let shape = Shape::new(1, 16);
    let mut vm = pattern_vm_at_pause_point(&vmm, shape, size, 0xabcdef);
    let regs = vm.regs(0).unwrap();
    let sregs = vm.sregs(0).unwrap();
    let m = vm.snapshot(dir.path(), &devices("queue-state")).unwrap();
    assert!(matches!(m.memory, MemoryRef::Full { size: s, .. } if s == 16 << 20));
    drop(vm);

    let snap = Snapshot::open(dir.path()).unwrap();
    snap.verify_memory().unwrap();
    assert_eq!(snap.device_state("note"), Some(&b"queue-state"[..]));
    let shell = VmShell::new(&vmm, shape).unwrap();
    let mut vm = restore_into(shell, &snap).unwrap();
    assert_eq!(format!("{:?}", vm.regs(0).unwrap()), format!("{regs:?}"));
    assert_eq!(format!("{:?}", vm.sregs(0).unwrap()), format!("{sregs:?}"));
    assert_eq!(
        vm.read_u64(test_guests::DATA_ADDR + size - 8).unwrap(),
        (test_guests::DATA_ADDR + size - 8) ^ 0xabcdef
    );
    vm.write_u64(test_guests::PARAMS_ADDR + 16, 42).unwrap();
    let r = vm.run_until(TIMEOUT).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "guest saw its pattern and registers intact"
    );
    assert_eq!(vm.regs(0).unwrap().r13, pattern_sum(size, 42));
}

#[test]
fn a_guest_snapshotted_mid_flight_keeps_counting_from_the_saved_values() {
    cube_testkit::require_kvm!(
        "a_guest_snapshotted_mid_flight_keeps_counting_from_the_saved_values"
    );
    let vmm = Vmm::new().unwrap();
    let dir = tmpdir("midflight");
    let shape = Shape::new(2, 8);
    let mut vm = vmm.create_vm(shape).unwrap();
    vm.load_test_guest(test_guests::SPIN).unwrap();
    vm.resume().unwrap();
    for _ in 0..2 {
        assert!(matches!(
            vm.next_event(TIMEOUT).unwrap(),
            Some((_, VcpuEvent::Checkpoint(_)))
        ));
    }
    until_counted_past(&vm, &[0, 0]);
    vm.pause().unwrap();
    let saved: Vec<u64> = (0..2).map(|i| vm.regs(i).unwrap().r12).collect();
    vm.snapshot(dir.path(), &BTreeMap::new()).unwrap();
    // The original keeps running; the snapshot must not follow it.
    vm.resume().unwrap();
    until_counted_past(&vm, &saved);
    vm.pause().unwrap();

    let snap = Snapshot::open(dir.path()).unwrap();
    let mut r = restore(&vmm, &snap).unwrap();
    for (i, &c) in saved.iter().enumerate() {
        assert_eq!(r.regs(i).unwrap().r12, c);
        assert_eq!(r.regs(i).unwrap().r13, 0x1111 * (i as u64 + 1));
    }
    r.resume().unwrap();
    // And it runs on from them.
    until_counted_past(&r, &saved);
    r.pause().unwrap();
}

#[test]
fn a_hundred_restores_of_one_snapshot_are_independent() {
    cube_testkit::require_kvm!("a_hundred_restores_of_one_snapshot_are_independent");
    let vmm = Vmm::new().unwrap();
    let dir = tmpdir("hundred");
    let size = 64 << 10;
    let shape = Shape::new(1, 8);
    let mut vm = pattern_vm_at_pause_point(&vmm, shape, size, 7);
    vm.snapshot(dir.path(), &BTreeMap::new()).unwrap();
    drop(vm);
    let file_before = std::fs::read(dir.path().join("memory.img")).unwrap();
    let snap = Snapshot::open(dir.path()).unwrap();
    let mut vms: Vec<Vm> = Vec::new();
    for id in 0..100u64 {
        let mut vm = restore_into(VmShell::new(&vmm, shape).unwrap(), &snap).unwrap();
        vm.write_u64(test_guests::PARAMS_ADDR + 16, 1000 + id)
            .unwrap();
        // Done(0) means the guest found the original pattern: no earlier clone's writes leaked.
        assert_eq!(
            vm.run_until(TIMEOUT).unwrap().outcome,
            RunOutcome::Done(0),
            "clone {id}"
        );
        assert_eq!(vm.regs(0).unwrap().r13, pattern_sum(size, 1000 + id));
        vms.push(vm);
    }
    for (id, vm) in vms.iter().enumerate() {
        let a = test_guests::DATA_ADDR + 8 * (id as u64 % 100);
        assert_eq!(
            vm.read_u64(a).unwrap(),
            a ^ (1000 + id as u64),
            "clone {id} memory"
        );
    }
    drop(vms);
    assert!(
        std::fs::read(dir.path().join("memory.img")).unwrap() == file_before,
        "file untouched"
    );
    snap.verify_memory().unwrap();
}

fn fresh_snapshot(vmm: &Vmm, dir: &Path, shape: Shape) {
    let mut vm = pattern_vm_at_pause_point(vmm, shape, 4096, 3);
    vm.snapshot(dir, &devices("x")).unwrap();
}

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn corrupted_or_mismatched_snapshots_are_refused() {
    cube_testkit::require_kvm!("corrupted_or_mismatched_snapshots_are_refused");
    let vmm = Vmm::new().unwrap();
    let shape = Shape::new(1, 8);
    let base = tmpdir("refuse");
    let case = |name: &str| {
        let d = base.path().join(name);
        fresh_snapshot(&vmm, &d, shape);
        d
    };

    let d = case("ok");
    let snap = Snapshot::open(&d).unwrap();
    // Wrong shape of shell.
    let k = snapshot_kind(restore_into(
        VmShell::new(&vmm, Shape::new(2, 8)).unwrap(),
        &snap,
    ));
    assert!(
        matches!(k, SnapshotError::Mismatch { field: "shape", .. }),
        "{k:?}"
    );
    let k = snapshot_kind(restore_into(
        VmShell::new(&vmm, Shape::new(1, 16)).unwrap(),
        &snap,
    ));
    assert!(
        matches!(k, SnapshotError::Mismatch { field: "shape", .. }),
        "{k:?}"
    );

    // A flipped byte in vmstate.bin.
    let d = case("flip");
    let p = d.join("vmstate.bin");
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n / 2] ^= 0x10;
    std::fs::write(&p, &b).unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Checksum { .. }
    ));

    // Truncated vmstate.bin, garbage vmstate.bin.
    std::fs::write(&p, &b[..n / 3]).unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Malformed(_)
    ));
    std::fs::write(&p, b"hello").unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Malformed(_)
    ));

    // Memory file of the wrong size.
    let d = case("short");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("memory.img"))
        .unwrap();
    f.set_len(4 << 20).unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::MemorySize { .. }
    ));

    // Memory contents changed: caught by the full verification.
    let d = case("memflip");
    let p = d.join("memory.img");
    let mut m = std::fs::read(&p).unwrap();
    m[0x10_0000] ^= 1;
    std::fs::write(&p, &m).unwrap();
    let snap = Snapshot::open(&d).unwrap();
    assert!(matches!(
        snapshot_kind(snap.verify_memory()),
        SnapshotError::Checksum { .. }
    ));

    // Another CPU model / VMM version / format version / broken manifest / missing files.
    let d = case("cpu");
    edit_manifest(&d, |v| v["cpu_model_hash"] = "00ff".into());
    let snap = Snapshot::open(&d).unwrap();
    let k = snapshot_kind(restore_into(VmShell::new(&vmm, shape).unwrap(), &snap));
    assert!(
        matches!(
            k,
            SnapshotError::Mismatch {
                field: "cpu_model_hash",
                ..
            }
        ),
        "{k:?}"
    );
    let d = case("vmmver");
    edit_manifest(&d, |v| v["vmm_version"] = "0.0.0-other".into());
    let snap = Snapshot::open(&d).unwrap();
    let k = snapshot_kind(restore(&vmm, &snap));
    assert!(
        matches!(
            k,
            SnapshotError::Mismatch {
                field: "vmm_version",
                ..
            }
        ),
        "{k:?}"
    );
    let d = case("fmt");
    edit_manifest(&d, |v| v["format_version"] = 99.into());
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::UnsupportedVersion { found: 99, .. }
    ));
    let d = case("vcpus");
    edit_manifest(&d, |v| v["vcpus"] = 3.into());
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Mismatch { field: "vcpus", .. }
    ));
    let d = case("crc");
    edit_manifest(&d, |v| v["vmstate_crc32"] = 1.into());
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Checksum { .. }
    ));
    let d = case("garbage");
    std::fs::write(d.join("manifest.json"), b"{not json").unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Malformed(_)
    ));
    let d = case("missing");
    std::fs::remove_file(d.join("memory.img")).unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Missing(_)
    ));
    std::fs::remove_file(d.join("manifest.json")).unwrap();
    assert!(matches!(
        snapshot_kind(Snapshot::open(&d)),
        SnapshotError::Missing(_)
    ));
    assert!(Snapshot::open(Path::new("/nonexistent/snapshot")).is_err());
}

#[test]
fn pause_to_disk_writes_only_dirty_pages_and_resumes_in_a_new_process() {
    cube_testkit::require_kvm!(
        "pause_to_disk_writes_only_dirty_pages_and_resumes_in_a_new_process"
    );
    let vmm = Vmm::new().unwrap();
    let base = tmpdir("p2d-base");
    let paused = tmpdir("p2d-paused");
    let shape = Shape::new(2, 32);
    let mut vm = vmm.create_vm(shape).unwrap();
    vm.load_test_guest(test_guests::SPIN).unwrap();
    vm.resume().unwrap();
    for _ in 0..2 {
        assert!(matches!(
            vm.next_event(TIMEOUT).unwrap(),
            Some((_, VcpuEvent::Checkpoint(_)))
        ));
    }
    vm.pause().unwrap();
    vm.snapshot(base.path(), &BTreeMap::new()).unwrap();
    drop(vm);

    let snap = Snapshot::open(base.path()).unwrap();
    let mut vm = restore(&vmm, &snap).unwrap();
    vm.resume().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    vm.pause().unwrap();
    // Host-side writes (as a device's DMA would do) must be captured too: 1 MiB at 16 MiB.
    let blob: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    vm.write_bytes(16 << 20, &blob).unwrap();
    let counts: Vec<u64> = (0..2).map(|i| vm.regs(i).unwrap().r12).collect();
    let m = vm.pause_to_disk(paused.path(), &devices("dev")).unwrap();
    let MemoryRef::Diff {
        runs, base_path, ..
    } = &m.memory
    else {
        panic!("expected a diff image, got {:?}", m.memory)
    };
    assert_eq!(
        base_path,
        &std::fs::canonicalize(base.path().join("memory.img")).unwrap()
    );
    let pages: u64 = runs.iter().map(|r| r.1).sum();
    // 256 pages of blob + the counter page + the stack/whatever the guest touched: few pages.
    assert!((256..300).contains(&pages), "{pages} dirty pages: {runs:?}");
    drop(vm);

    // Resume in a new process: the debug binary restores, reports, runs 20 ms, reports again.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cube-hypervisor"))
        .args(["restore", "--dir"])
        .arg(paused.path())
        .args([
            "--run-ms",
            "20",
            "--json",
            "--read",
            &format!("{}:{}", 16 << 20, 1 << 20),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for (i, &c) in counts.iter().enumerate() {
        assert_eq!(
            v["before"][i]["r12"].as_u64().unwrap(),
            c,
            "vCPU {i} resumed at its count"
        );
        assert!(
            v["after"][i]["r12"].as_u64().unwrap() > c,
            "vCPU {i} kept counting"
        );
    }
    assert_eq!(
        v["read_crc32"].as_u64().unwrap(),
        crc32fast::hash(&blob) as u64
    );
    assert_eq!(v["devices"]["note"].as_str().unwrap(), "dev");

    // A second pause-to-disk of a VM resumed from a diff still carries the first diff's pages.
    let snap2 = Snapshot::open(paused.path()).unwrap();
    let mut vm = restore(&vmm, &snap2).unwrap();
    let again = tmpdir("p2d-again");
    let m2 = vm.pause_to_disk(again.path(), &BTreeMap::new()).unwrap();
    let MemoryRef::Diff { runs: runs2, .. } = &m2.memory else {
        panic!()
    };
    let pages2: u64 = runs2.iter().map(|r| r.1).sum();
    assert!(pages2 >= pages, "{pages2} < {pages}");
    drop(vm);
    let snap3 = Snapshot::open(again.path()).unwrap();
    let vm = restore(&vmm, &snap3).unwrap();
    let mut back = vec![0u8; 1 << 20];
    vm.read_bytes(16 << 20, &mut back).unwrap();
    assert!(back == blob);
}

#[test]
fn a_shell_prepared_for_a_template_restores_it_and_still_restores_others_correctly() {
    cube_testkit::require_kvm!(
        "a_shell_prepared_for_a_template_restores_it_and_still_restores_others_correctly"
    );
    let vmm = Vmm::new().unwrap();
    let shape = Shape::new(1, 8);
    let size = 16 << 10;
    let (a, b) = (tmpdir("prep-a"), tmpdir("prep-b"));
    pattern_vm_at_pause_point(&vmm, shape, size, 0xa)
        .snapshot(a.path(), &BTreeMap::new())
        .unwrap();
    pattern_vm_at_pause_point(&vmm, shape, size, 0xb)
        .snapshot(b.path(), &BTreeMap::new())
        .unwrap();
    let (sa, sb) = (
        Snapshot::open(a.path()).unwrap(),
        Snapshot::open(b.path()).unwrap(),
    );
    for (snap, seed) in [(&sa, 0xa), (&sb, 0xb)] {
        let mut shell = VmShell::new(&vmm, shape).unwrap();
        shell.prepare(&sa).unwrap();
        let mut vm = restore_into(shell, snap).unwrap();
        assert_eq!(
            vm.read_u64(test_guests::DATA_ADDR).unwrap(),
            test_guests::DATA_ADDR ^ seed
        );
        vm.write_u64(test_guests::PARAMS_ADDR + 16, 5).unwrap();
        assert_eq!(vm.run_until(TIMEOUT).unwrap().outcome, RunOutcome::Done(0));
    }
    let mut wrong = VmShell::new(&vmm, Shape::new(1, 16)).unwrap();
    assert!(matches!(
        snapshot_kind(wrong.prepare(&sa)),
        SnapshotError::Mismatch { field: "shape", .. }
    ));
}

#[test]
fn timer_interrupts_keep_arriving_after_a_restore() {
    cube_testkit::require_kvm!("timer_interrupts_keep_arriving_after_a_restore");
    let vmm = Vmm::new().unwrap();
    let dir = tmpdir("timer");
    let shape = Shape::new(1, 8);
    let mut vm = vmm.create_vm(shape).unwrap();
    vm.load_test_guest(test_guests::TIMER).unwrap();
    let want = 200u64;
    vm.write_u64(test_guests::PARAMS_ADDR, want).unwrap();
    vm.resume().unwrap();
    // Wait until the guest has programmed PIC + PIT and the first ticks arrived.
    let deadline = std::time::Instant::now() + TIMEOUT;
    while vm.read_u64(test_guests::DATA_ADDR).unwrap() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no timer ticks before the snapshot"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    vm.pause().unwrap();
    let ticks = vm.read_u64(test_guests::DATA_ADDR).unwrap();
    assert!(
        ticks < want,
        "guest finished before the snapshot ({ticks} ticks)"
    );
    vm.snapshot(dir.path(), &BTreeMap::new()).unwrap();
    drop(vm);
    // The restored guest never reprograms anything: ticks only arrive if the PIC, PIT, IDT
    // and LAPIC state came back.
    let snap = Snapshot::open(dir.path()).unwrap();
    let mut vm = restore_into(VmShell::new(&vmm, shape).unwrap(), &snap).unwrap();
    let r = vm.run_until(Duration::from_secs(60)).unwrap();
    assert_eq!(
        r.outcome,
        RunOutcome::Done(0),
        "checkpoints {:?}",
        r.checkpoints
    );
    assert!(vm.read_u64(test_guests::DATA_ADDR).unwrap() >= want);
}
