//! Snapshots: create (full, or pause-to-disk diff against the memory file a VM was restored
//! from), open + verify, and restore into a pre-created [`VmShell`].
//!
//! A snapshot directory holds `manifest.json`, `vmstate.bin` and `memory.img` (full) or
//! `memory.diff` (pause-to-disk). The manifest is written last, so a directory without one is
//! an unfinished snapshot. [`Snapshot::open`] checks the manifest, the vmstate checksum and
//! the memory file sizes; [`restore_into`] also checks the host (VMM version, CPU model hash)
//! and the shell's shape. Memory contents are checked by [`Snapshot::verify_memory`] (a full
//! read, so not on the restore path).

pub mod format;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{io, snap, Error, Result, SnapshotError};
use crate::shell::VmShell;
use crate::vmm::{MemoryBase, Shape, Vm, Vmm};
use crate::vstate::memory::{bitmap_runs, PAGE_SIZE};
use format::*;

pub use format::{Manifest, MemoryRef, VmSnapshotState};

/// Device states by name, as bytes the device owner produced (e.g. `serde_json` of `state()`).
pub type DeviceStates = BTreeMap<String, Vec<u8>>;

/// An opened, verified snapshot. Cheap to restore many times (the memory file stays open).
pub struct Snapshot {
    dir: PathBuf,
    manifest: Manifest,
    state: VmSnapshotState,
    memory: File,
    memory_path: PathBuf,
    diff: Option<File>,
    /// (device, inode) of the memory file and of the diff file: what a prepared shell mapped.
    pub(crate) identity: FileIdentity,
}

/// Identifies the files a snapshot's memory is mapped from.
pub(crate) type FileIdentity = ((u64, u64), Option<(u64, u64)>);

fn file_id(f: &File) -> Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().map_err(|e| Error::Sys {
        op: "fstat",
        source: e,
    })?;
    Ok((m.dev(), m.ino()))
}

/// Maps a snapshot's memory (base file, then diff runs) over a VM's RAM.
fn map_snapshot_memory(ram: &mut crate::vstate::memory::GuestRam, snap_: &Snapshot) -> Result<()> {
    let size = ram.size();
    ram.map_file(&snap_.memory, 0, 0, size)?;
    ram.clear_overlay();
    if let (Some(diff), MemoryRef::Diff { runs, .. }) = (&snap_.diff, &snap_.manifest.memory) {
        for &(first, pages) in runs {
            let off = first * PAGE_SIZE;
            ram.map_file(diff, off, off, pages * PAGE_SIZE)?;
            ram.add_overlay(first, pages);
        }
    }
    Ok(())
}

fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
    f.write_all(bytes).map_err(io("write", &tmp))?;
    f.sync_all().map_err(io("fsync", &tmp))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(io("rename", dir.join(name)))
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Writes the page runs of `mem` at their own offsets of `f`, split across a few threads:
/// the cost is page allocation + copy in the file system, which scales with cores.
fn write_pages_parallel(f: &File, mem: &[u8], runs: &[(u64, u64)]) -> std::io::Result<()> {
    // Cut runs into pieces of at most 4 MiB, dealt round-robin to the workers.
    const PIECE: u64 = (4 << 20) / PAGE_SIZE;
    let mut pieces = Vec::new();
    for &(first, pages) in runs {
        let mut p = first;
        while p < first + pages {
            let n = PIECE.min(first + pages - p);
            pieces.push((p * PAGE_SIZE, n * PAGE_SIZE));
            p += n;
        }
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
        .min(pieces.len().max(1));
    let write = |k: usize| -> std::io::Result<()> {
        for &(off, len) in pieces.iter().skip(k).step_by(threads) {
            let (o, l) = (off as usize, len as usize);
            f.write_all_at(&mem[o..o + l], off)?;
        }
        Ok(())
    };
    if threads == 1 {
        return write(0);
    }
    std::thread::scope(|sc| {
        let handles: Vec<_> = (1..threads).map(|k| sc.spawn(move || write(k))).collect();
        let mut result = write(0);
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("writer thread panicked")));
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}

/// Memory checksum: CRC32 over (page index as u64 LE ‖ page bytes) of every non-zero 4 KiB
/// page, so holes and untouched memory cost nothing to hash.
struct MemoryDigest(crc32fast::Hasher);

impl MemoryDigest {
    fn new() -> Self {
        MemoryDigest(crc32fast::Hasher::new())
    }
    fn page(&mut self, index: u64, bytes: &[u8]) {
        self.0.update(&index.to_le_bytes());
        self.0.update(bytes);
    }
    fn finish(self) -> u32 {
        self.0.finalize()
    }
}

fn is_zero(page: &[u8]) -> bool {
    let (pre, words, post) = unsafe { page.align_to::<u64>() };
    pre.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

impl Vm {
    /// Writes a full snapshot of this VM into `dir` (created if needed). All-zero pages are
    /// left as holes in `memory.img`.
    ///
    /// Order (as Firecracker does it): [`Vm::pause`] first, then quiesce device workers and
    /// collect each device's `state()` into `devices`, then call this, which saves vCPU state
    /// (MP state first, vCPU events last), VM state, memory and finally the manifest. A running
    /// VM is paused here, but device states collected while it ran may be inconsistent.
    pub fn snapshot(&mut self, dir: &Path, devices: &DeviceStates) -> Result<Manifest> {
        if self.is_running() {
            self.pause()?;
        }
        std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
        let (vcpus, vm) = self.save_state()?;
        let size = self.ram.size();
        // New inode + rename: the VM may be running from the old memory.img of this directory.
        let tmp = dir.join(format!(".{MEMORY_FILE}.tmp"));
        let f = File::create(&tmp).map_err(io("create", &tmp))?;
        f.set_len(size).map_err(io("truncate", &tmp))?;
        // SAFETY: vCPUs are paused; device owners must have quiesced their workers.
        let mem = unsafe { self.ram.as_slice() };
        let candidates = self.ram.possibly_nonzero_pages()?;
        let mut digest = MemoryDigest::new();
        let page = PAGE_SIZE as usize;
        // Write runs of non-zero pages; zero pages stay holes (and are never faulted in when
        // the memory is anonymous and untouched).
        let mut p = 0usize;
        let pages = mem.len() / page;
        while p < pages {
            let start = p;
            while p < pages
                && candidates[p / 64] & (1 << (p % 64)) != 0
                && !is_zero(&mem[p * page..(p + 1) * page])
            {
                digest.page(p as u64, &mem[p * page..(p + 1) * page]);
                p += 1;
            }
            if p > start {
                f.write_all_at(&mem[start * page..p * page], (start * page) as u64)
                    .map_err(io("write", &tmp))?;
            } else {
                p += 1;
            }
        }
        f.sync_all().map_err(io("fsync", &tmp))?;
        std::fs::rename(&tmp, dir.join(MEMORY_FILE))
            .map_err(io("rename", dir.join(MEMORY_FILE)))?;
        let memory = MemoryRef::Full {
            size,
            crc32: digest.finish(),
        };
        self.write_state_and_manifest(dir, vcpus, vm, devices, memory)
    }

    fn write_state_and_manifest(
        &self,
        dir: &Path,
        vcpus: Vec<crate::vstate::vcpu::VcpuState>,
        vm: crate::vstate::vm::VmState,
        devices: &DeviceStates,
        memory: MemoryRef,
    ) -> Result<Manifest> {
        let state = VmSnapshotState {
            vcpus,
            vm,
            devices: devices.clone(),
        };
        let (bytes, crc) = encode_state(&state)?;
        write_atomic(dir, VMSTATE_FILE, &bytes)?;
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            cpu_model_hash: self.vmm.cpu_model_hash().to_string(),
            vcpus: self.shape.vcpus,
            mem_mib: self.shape.mem_mib,
            kernel_digest: self.kernel_digest.clone(),
            created_unix: now_unix(),
            vmstate_crc32: crc,
            memory,
        };
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| snap(dir, SnapshotError::Malformed(format!("manifest: {e}"))))?;
        write_atomic(dir, MANIFEST_FILE, &json)?;
        Ok(manifest)
    }

    /// Pause to disk: pauses the VM and writes its state plus only the pages that differ from
    /// the memory file it was restored from (see [`crate::vstate::memory::GuestRam::dirty_pages`]),
    /// with a reference (path, size, CRC32) to that base file. A VM that was booted rather than
    /// restored has no base: a full snapshot is written instead.
    pub fn pause_to_disk(&mut self, dir: &Path, devices: &DeviceStates) -> Result<Manifest> {
        if self.is_running() {
            self.pause()?;
        }
        let Some(base) = self.base.clone() else {
            return self.snapshot(dir, devices);
        };
        std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
        let (vcpus, vm) = self.save_state()?;
        let size = self.ram.size();
        let bitmap = self.ram.dirty_pages()?;
        let runs = bitmap_runs(&bitmap, size / PAGE_SIZE);
        let tmp = dir.join(format!(".{DIFF_FILE}.tmp"));
        let f = File::create(&tmp).map_err(io("create", &tmp))?;
        f.set_len(size).map_err(io("truncate", &tmp))?;
        // SAFETY: the VM is paused.
        let mem = unsafe { self.ram.as_slice() };
        write_pages_parallel(&f, mem, &runs).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        std::fs::rename(&tmp, dir.join(DIFF_FILE)).map_err(io("rename", dir.join(DIFF_FILE)))?;
        let memory = MemoryRef::Diff {
            base_path: base.path.clone(),
            base_size: base.size,
            base_crc32: base.crc32,
            runs,
        };
        self.write_state_and_manifest(dir, vcpus, vm, devices, memory)
    }
}

impl Snapshot {
    /// Opens and checks a snapshot directory (manifest, vmstate checksum, memory file sizes).
    pub fn open(dir: &Path) -> Result<Snapshot> {
        let mpath = dir.join(MANIFEST_FILE);
        let mbytes = match std::fs::read(&mpath) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(snap(dir, SnapshotError::Missing(MANIFEST_FILE.into())))
            }
            Err(e) => return Err(io("read", &mpath)(e)),
        };
        // The version is checked before the rest so a newer format gives a clear error.
        let version = serde_json::from_slice::<serde_json::Value>(&mbytes)
            .ok()
            .and_then(|v| v.get("format_version").and_then(|x| x.as_u64()));
        match version {
            Some(v) if v == FORMAT_VERSION as u64 => {}
            Some(v) => {
                return Err(snap(
                    &mpath,
                    SnapshotError::UnsupportedVersion {
                        found: v.min(u32::MAX as u64) as u32,
                        supported: FORMAT_VERSION,
                    },
                ))
            }
            None => return Err(snap(&mpath, SnapshotError::Malformed(MANIFEST_FILE.into()))),
        }
        let manifest: Manifest = serde_json::from_slice(&mbytes).map_err(|e| {
            snap(
                &mpath,
                SnapshotError::Malformed(format!("{MANIFEST_FILE}: {e}")),
            )
        })?;
        let spath = dir.join(VMSTATE_FILE);
        let sbytes = match std::fs::read(&spath) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(snap(dir, SnapshotError::Missing(VMSTATE_FILE.into())))
            }
            Err(e) => return Err(io("read", &spath)(e)),
        };
        let (state, crc) = decode_state(&spath, &sbytes)?;
        if crc != manifest.vmstate_crc32 {
            return Err(snap(
                &spath,
                SnapshotError::Checksum {
                    file: VMSTATE_FILE.into(),
                    stored: manifest.vmstate_crc32 as u64,
                    computed: crc as u64,
                },
            ));
        }
        if state.vcpus.len() != manifest.vcpus as usize || manifest.vcpus == 0 {
            return Err(snap(
                dir,
                SnapshotError::Mismatch {
                    field: "vcpus",
                    snapshot: state.vcpus.len().to_string(),
                    expected: manifest.vcpus.to_string(),
                },
            ));
        }
        let mem_bytes = (manifest.mem_mib as u64) << 20;
        let open_sized = |p: &Path, name: &str| -> Result<File> {
            let f = match File::open(p) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(snap(dir, SnapshotError::Missing(name.into())))
                }
                Err(e) => return Err(io("open", p)(e)),
            };
            let len = f.metadata().map_err(io("stat", p))?.len();
            if len != mem_bytes {
                return Err(snap(
                    p,
                    SnapshotError::MemorySize {
                        found: len,
                        expected: mem_bytes,
                    },
                ));
            }
            Ok(f)
        };
        let (memory, memory_path, diff) = match &manifest.memory {
            MemoryRef::Full { size, .. } => {
                if *size != mem_bytes {
                    return Err(snap(
                        dir,
                        SnapshotError::MemorySize {
                            found: *size,
                            expected: mem_bytes,
                        },
                    ));
                }
                let p = dir.join(MEMORY_FILE);
                let f = open_sized(&p, MEMORY_FILE)?;
                let p = std::fs::canonicalize(&p).map_err(io("resolve", &p))?;
                (f, p, None)
            }
            MemoryRef::Diff {
                base_path,
                base_size,
                runs,
                ..
            } => {
                if *base_size != mem_bytes {
                    return Err(snap(
                        dir,
                        SnapshotError::MemorySize {
                            found: *base_size,
                            expected: mem_bytes,
                        },
                    ));
                }
                let pages = mem_bytes / PAGE_SIZE;
                if runs
                    .iter()
                    .any(|&(a, n)| n == 0 || a.checked_add(n).is_none_or(|e| e > pages))
                {
                    return Err(snap(dir, SnapshotError::Malformed("diff page runs".into())));
                }
                let base = open_sized(base_path, "base memory file")?;
                let diff = open_sized(&dir.join(DIFF_FILE), DIFF_FILE)?;
                (base, base_path.clone(), Some(diff))
            }
        };
        let identity = (file_id(&memory)?, diff.as_ref().map(file_id).transpose()?);
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            manifest,
            state,
            memory,
            memory_path,
            diff,
            identity,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn shape(&self) -> Shape {
        Shape::new(self.manifest.vcpus, self.manifest.mem_mib)
    }

    pub fn state(&self) -> &VmSnapshotState {
        &self.state
    }

    /// A device's saved state, as its owner wrote it.
    pub fn device_state(&self, name: &str) -> Option<&[u8]> {
        self.state.devices.get(name).map(|v| v.as_slice())
    }

    /// Reads the whole memory file and checks its digest (CRC32 over index ‖ bytes of each
    /// non-zero page) against the manifest (for a diff
    /// image: the base file against the recorded base checksum).
    pub fn verify_memory(&self) -> Result<()> {
        let stored = match &self.manifest.memory {
            MemoryRef::Full { crc32, .. } => *crc32,
            MemoryRef::Diff { base_crc32, .. } => *base_crc32,
        };
        let mut h = MemoryDigest::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        loop {
            // Fill the buffer completely (short reads would misalign page indices).
            let mut n = 0;
            while n < buf.len() {
                let r = self
                    .memory
                    .read_at(&mut buf[n..], off + n as u64)
                    .map_err(io("read", &self.memory_path))?;
                if r == 0 {
                    break;
                }
                n += r;
            }
            if n == 0 {
                break;
            }
            for (i, pg) in buf[..n].chunks(PAGE_SIZE as usize).enumerate() {
                if !is_zero(pg) {
                    h.page(off / PAGE_SIZE + i as u64, pg);
                }
            }
            off += n as u64;
        }
        let computed = h.finish();
        if computed != stored {
            return Err(snap(
                &self.memory_path,
                SnapshotError::Checksum {
                    file: self.memory_path.display().to_string(),
                    stored: stored as u64,
                    computed: computed as u64,
                },
            ));
        }
        Ok(())
    }

    /// Refuses a snapshot made by another VMM version or on another CPU model / KVM flavour.
    pub fn check_host(&self, vmm: &Vmm) -> Result<()> {
        let mm = |field, snapshot: &str, expected: &str| {
            snap(
                &self.dir,
                SnapshotError::Mismatch {
                    field,
                    snapshot: snapshot.to_string(),
                    expected: expected.to_string(),
                },
            )
        };
        if self.manifest.vmm_version != env!("CARGO_PKG_VERSION") {
            return Err(mm(
                "vmm_version",
                &self.manifest.vmm_version,
                env!("CARGO_PKG_VERSION"),
            ));
        }
        if self.manifest.cpu_model_hash != vmm.cpu_model_hash() {
            return Err(mm(
                "cpu_model_hash",
                &self.manifest.cpu_model_hash,
                vmm.cpu_model_hash(),
            ));
        }
        Ok(())
    }
}

/// Restores `snap` into a pre-created shell: maps the memory file `MAP_PRIVATE|MAP_FIXED` over
/// the shell's placeholder (pages load on demand, writes stay private), overlays a pause-to-disk
/// diff if any, and loads vCPU and VM state. The returned VM is paused: rebuild devices from
/// [`Snapshot::device_state`] with new backends, attach them, then [`Vm::resume`].
pub fn restore_into(shell: VmShell, snap_: &Snapshot) -> Result<Vm> {
    snap_.check_host(&shell.vm.vmm)?;
    let want = snap_.shape();
    if shell.shape() != want {
        return Err(snap(
            &snap_.dir,
            SnapshotError::Mismatch {
                field: "shape",
                snapshot: format!("{} vCPUs / {} MiB", want.vcpus, want.mem_mib),
                expected: format!(
                    "{} vCPUs / {} MiB",
                    shell.shape().vcpus,
                    shell.shape().mem_mib
                ),
            },
        ));
    }
    let prepared = shell.prepared_for == Some(snap_.identity);
    let mut vm = shell.vm;
    if !prepared {
        map_snapshot_memory(&mut vm.ram, snap_)?;
    }
    vm.restore_kvm_state(&snap_.state.vcpus, &snap_.state.vm)
        .map_err(|e| match e {
            Error::Snapshot { kind, .. } => snap(&snap_.dir, kind),
            other => other,
        })?;
    vm.base = Some(match &snap_.manifest.memory {
        MemoryRef::Full { size, crc32 } => MemoryBase {
            path: snap_.memory_path.clone(),
            size: *size,
            crc32: *crc32,
        },
        MemoryRef::Diff {
            base_path,
            base_size,
            base_crc32,
            ..
        } => MemoryBase {
            path: base_path.clone(),
            size: *base_size,
            crc32: *base_crc32,
        },
    });
    vm.kernel_digest = snap_.manifest.kernel_digest.clone();
    Ok(vm)
}

impl VmShell {
    /// Binds this shell to a template ahead of time: maps the snapshot's memory file over the
    /// placeholder now, so that [`restore_into`] with the same snapshot only loads state. The
    /// mapping is private and untouched until the restore, so the shell stays clean. For pools
    /// kept per template (the MAP_FIXED of a large mapping costs ~0.5 ms per 2 GiB here).
    pub fn prepare(&mut self, snap_: &Snapshot) -> Result<()> {
        if self.shape() != snap_.shape() {
            return Err(snap(
                &snap_.dir,
                SnapshotError::Mismatch {
                    field: "shape",
                    snapshot: format!(
                        "{} vCPUs / {} MiB",
                        snap_.shape().vcpus,
                        snap_.shape().mem_mib
                    ),
                    expected: format!(
                        "{} vCPUs / {} MiB",
                        self.shape().vcpus,
                        self.shape().mem_mib
                    ),
                },
            ));
        }
        map_snapshot_memory(&mut self.vm.ram, snap_)?;
        self.prepared_for = Some(snap_.identity);
        Ok(())
    }
}

/// Cold restore: creates the VM (memslot, vCPUs) now, then [`restore_into`] it.
pub fn restore(vmm: &Vmm, snap_: &Snapshot) -> Result<Vm> {
    snap_.check_host(vmm)?;
    restore_into(VmShell::new(vmm, snap_.shape())?, snap_)
}
