//! The sandbox one shim hosts: a pre-created shell, then one VM, and the control ops on it.
//! Every op returns a [`Response`]; failures are typed error responses, never panics.

use std::path::Path;
use std::time::{Duration, Instant};

use cube_hypervisor::{restore_into, Error, Shape, Snapshot, VcpuEvent, Vm, VmShell, Vmm};

use crate::devices::{self, BackendNames, Devices};
use crate::protocol::{
    ErrorKind, ErrorReply, GuestStatus, Op, Reply, Response, SandboxState, ShapeInfo, MAX_PEEK,
};
use crate::stats;

/// Most recent checkpoint values kept (a guest may checkpoint in a loop).
const MAX_CHECKPOINTS: usize = 256;

pub struct Sandbox {
    vmm: Vmm,
    shape: Shape,
    shell: Option<VmShell>,
    /// The template the shell was prepared for ([`Sandbox::prepare`]), kept open.
    prepared: Option<(std::path::PathBuf, Snapshot)>,
    /// Before `vm`: fields drop in order, and the devices' workers write the VM's memory.
    devices: Devices,
    vm: Option<Vm>,
    state: SandboxState,
    guest: GuestStatus,
    checkpoints: Vec<u32>,
    /// Whether the seccomp filter is on (reported by `ping`).
    pub seccomp: bool,
    /// The pid `ping` reports: the host pid cubelet tracks (in a PID namespace of its own the
    /// shim is PID 1 and its supervisor holds that pid, see [`crate::jail::enter_pid_ns`]).
    pub host_pid: u32,
    /// Set by `stop`: the server exits after answering.
    pub stopping: bool,
}

fn hv_err(e: Error) -> ErrorReply {
    let kind = match &e {
        Error::Snapshot { .. } => ErrorKind::Snapshot,
        Error::InvalidConfig(_) => ErrorKind::BadRequest,
        Error::WrongState(_) => ErrorKind::WrongState,
        _ => ErrorKind::Internal,
    };
    ErrorReply::new(kind, e.to_string())
}

fn wrong_state(op: &str, state: SandboxState) -> ErrorReply {
    ErrorReply::new(
        ErrorKind::WrongState,
        format!("cannot {op} while the sandbox is {state:?}"),
    )
}

impl Sandbox {
    /// Opens KVM and pre-creates the shell (the slow part, done before any request).
    pub fn new(shape: Shape) -> Result<Sandbox, Error> {
        Sandbox::with_vmm(Vmm::new()?, shape)
    }

    /// Pre-creates the shell on a KVM opened earlier (the jailed shim opens `/dev/kvm` before
    /// it drops its privileges, and creates the shell, with its threads, after).
    pub fn with_vmm(vmm: Vmm, shape: Shape) -> Result<Sandbox, Error> {
        let shell = VmShell::new(&vmm, shape)?;
        Ok(Sandbox {
            vmm,
            shape,
            shell: Some(shell),
            prepared: None,
            vm: None,
            devices: Devices::default(),
            state: SandboxState::Ready,
            guest: GuestStatus::Active,
            checkpoints: Vec::new(),
            seccomp: false,
            host_pid: std::process::id(),
            stopping: false,
        })
    }

    /// Binds the shell to a template ahead of time: opens and checks it and maps its memory
    /// over the shell now, so that a `restore` naming the same directory only loads state.
    /// Templates are immutable: the opened files are used even if the directory is replaced.
    pub fn prepare(&mut self, dir: &Path) -> Result<(), ErrorReply> {
        let snap = self.open_checked(dir)?;
        let shell = self
            .shell
            .as_mut()
            .ok_or_else(|| wrong_state("prepare", self.state))?;
        shell.prepare(&snap).map_err(hv_err)?;
        self.prepared = Some((dir.to_path_buf(), snap));
        Ok(())
    }

    pub fn state(&self) -> SandboxState {
        self.state
    }

    /// Records what the vCPUs reported since the last call (without blocking).
    pub fn drain_events(&mut self) {
        loop {
            let ev = match &self.vm {
                Some(vm) => vm.next_event(Duration::ZERO),
                None => return,
            };
            match ev {
                Ok(Some((_, ev))) => self.record(ev),
                Ok(None) => return,
                Err(e) => {
                    self.guest = GuestStatus::Error {
                        message: e.to_string(),
                    };
                    return;
                }
            }
        }
    }

    fn record(&mut self, ev: VcpuEvent) {
        match ev {
            VcpuEvent::Checkpoint(v) => {
                if self.checkpoints.len() == MAX_CHECKPOINTS {
                    self.checkpoints.remove(0);
                }
                self.checkpoints.push(v);
            }
            VcpuEvent::Done(code) => self.guest = GuestStatus::Done { code },
            VcpuEvent::PausePoint(value) => self.guest = GuestStatus::PausePoint { value },
            VcpuEvent::Shutdown => self.guest = GuestStatus::Shutdown,
            VcpuEvent::Error(message) => self.guest = GuestStatus::Error { message },
        }
    }

    pub fn handle(&mut self, op: Op) -> Response {
        self.drain_events();
        let r = match op {
            Op::Ping => Ok(Reply::Pong {
                pid: self.host_pid,
                shape: ShapeInfo {
                    vcpus: self.shape.vcpus,
                    mem_mib: self.shape.mem_mib,
                },
                state: self.state,
                seccomp: self.seccomp,
            }),
            Op::Restore {
                snapshot,
                disk,
                tap,
                vsock,
            } => self.restore(
                &snapshot,
                BackendNames {
                    disk: disk.as_deref(),
                    tap: tap.as_deref(),
                    vsock: vsock.as_deref(),
                },
            ),
            Op::Pause => self.pause(),
            Op::PauseToDisk { dir } => self.pause_to_disk(&dir),
            Op::Resume {
                dir: None,
                disk,
                tap,
                vsock,
            } => {
                if disk.is_none() && tap.is_none() && vsock.is_none() {
                    self.resume()
                } else {
                    Err(ErrorReply::new(
                        ErrorKind::BadRequest,
                        "`disk`, `tap` and `vsock` only go with `dir` (resume from a pause-to-disk directory)",
                    ))
                }
            }
            Op::Resume {
                dir: Some(dir),
                disk,
                tap,
                vsock,
            } => self.resume_from_disk(
                &dir,
                BackendNames {
                    disk: disk.as_deref(),
                    tap: tap.as_deref(),
                    vsock: vsock.as_deref(),
                },
            ),
            Op::Snapshot { dir } => self.snapshot(&dir),
            Op::Stop => {
                // Drop the devices (backend workers joined) before the VM whose memory they
                // write, then the VM (vCPU threads joined, memory released), then exit.
                self.devices = Devices::default();
                self.vm = None;
                self.shell = None;
                self.stopping = true;
                Ok(Reply::Stopped)
            }
            Op::Stats => self.stats(),
            Op::Wait { timeout_ms } => Ok(self.wait(Duration::from_millis(timeout_ms))),
            Op::Peek { gpa, count, stride } => self.peek(gpa, count, stride.unwrap_or(8)),
        };
        r.map(Response::ok).unwrap_or_else(Response::from)
    }

    fn restore(&mut self, dir: &Path, names: BackendNames<'_>) -> Result<Reply, ErrorReply> {
        let t0 = Instant::now();
        if self.state != SandboxState::Ready {
            return Err(wrong_state("restore", self.state));
        }
        self.restore_dir(dir, names)?;
        Ok(Reply::Restored {
            restore_us: t0.elapsed().as_micros() as u64,
        })
    }

    /// Opens `dir`, checks it fits the shell (keeping the shell on refusal), restores, runs.
    fn open_checked(&self, dir: &Path) -> Result<Snapshot, ErrorReply> {
        let snap = Snapshot::open(dir).map_err(hv_err)?;
        snap.check_host(&self.vmm).map_err(hv_err)?;
        if snap.shape() != self.shape {
            return Err(ErrorReply::new(
                ErrorKind::Snapshot,
                format!(
                    "snapshot {} is for {} vCPUs / {} MiB but this shim was started for {} vCPUs / {} MiB",
                    dir.display(),
                    snap.shape().vcpus,
                    snap.shape().mem_mib,
                    self.shape.vcpus,
                    self.shape.mem_mib
                ),
            ));
        }
        Ok(snap)
    }

    fn restore_dir(&mut self, dir: &Path, names: BackendNames<'_>) -> Result<(), ErrorReply> {
        let snap = match self.prepared.take() {
            Some((p, snap)) if p == dir => snap,
            _ => self.open_checked(dir)?,
        };
        let tq = Instant::now();
        let backends = devices::open_backends(&snap, names)?;
        let t_open = tq.elapsed();
        let shell = match self.shell.take() {
            Some(s) => s,
            None => VmShell::new(&self.vmm, self.shape).map_err(hv_err)?,
        };
        let mut vm = match restore_into(shell, &snap) {
            Ok(vm) => vm,
            Err(e) => {
                // The shell was consumed: the shim can still take `resume {dir}` (new shell).
                self.state = SandboxState::Empty;
                return Err(hv_err(e));
            }
        };
        let t_vm = tq.elapsed();
        let devs = match Devices::restore(&snap, &mut vm, backends) {
            Ok(d) => d,
            Err(e) => {
                self.state = SandboxState::Empty;
                return Err(e);
            }
        };
        let t_dev = tq.elapsed();
        if let Err(e) = vm.resume() {
            self.state = SandboxState::Empty;
            return Err(hv_err(e));
        }
        devs.resume();
        // Cumulative: backends opened, VM state loaded, devices rebuilt, vCPUs running.
        tracing::debug!(
            backends_us = t_open.as_micros() as u64,
            vm_us = t_vm.as_micros() as u64,
            devices_us = t_dev.as_micros() as u64,
            running_us = tq.elapsed().as_micros() as u64,
            "restore steps"
        );
        self.vm = Some(vm);
        self.devices = devs;
        self.state = SandboxState::Running;
        self.guest = GuestStatus::Active;
        self.checkpoints.clear();
        Ok(())
    }

    fn vm_mut(&mut self, op: &str) -> Result<&mut Vm, ErrorReply> {
        let state = self.state;
        self.vm.as_mut().ok_or_else(|| wrong_state(op, state))
    }

    fn pause(&mut self) -> Result<Reply, ErrorReply> {
        if self.state != SandboxState::Running {
            return Err(wrong_state("pause", self.state));
        }
        self.vm_mut("pause")?.pause().map_err(hv_err)?;
        self.devices.pause();
        self.state = SandboxState::Paused;
        Ok(Reply::Paused)
    }

    fn resume(&mut self) -> Result<Reply, ErrorReply> {
        if self.state != SandboxState::Paused {
            return Err(wrong_state("resume", self.state));
        }
        self.vm_mut("resume")?.resume().map_err(hv_err)?;
        self.devices.resume();
        self.state = SandboxState::Running;
        self.guest = GuestStatus::Active;
        Ok(Reply::Resumed)
    }

    fn resume_from_disk(
        &mut self,
        dir: &Path,
        names: BackendNames<'_>,
    ) -> Result<Reply, ErrorReply> {
        match self.state {
            SandboxState::Ready | SandboxState::PausedToDisk | SandboxState::Empty => {}
            s => return Err(wrong_state("resume from disk", s)),
        }
        self.restore_dir(dir, names)?;
        Ok(Reply::Resumed)
    }

    fn pause_to_disk(&mut self, dir: &Path) -> Result<Reply, ErrorReply> {
        match self.state {
            SandboxState::Running | SandboxState::Paused => {}
            s => return Err(wrong_state("pause to disk", s)),
        }
        // Devices are quiet once the vCPUs (guest requests) and the workers (host input) are parked.
        self.vm_mut("pause to disk")?.pause().map_err(hv_err)?;
        self.devices.pause();
        self.state = SandboxState::Paused;
        let states = self.devices.states()?;
        self.vm_mut("pause to disk")?
            .pause_to_disk(dir, &states)
            .map_err(hv_err)?;
        // Release the guest's memory, vCPU threads and backends: the state lives in `dir` now.
        self.devices = Devices::default();
        self.vm = None;
        self.state = SandboxState::PausedToDisk;
        Ok(Reply::PausedToDisk {
            dir: dir.to_path_buf(),
        })
    }

    fn snapshot(&mut self, dir: &Path) -> Result<Reply, ErrorReply> {
        let was_running = match self.state {
            SandboxState::Running => true,
            SandboxState::Paused => false,
            s => return Err(wrong_state("snapshot", s)),
        };
        self.vm_mut("snapshot")?.pause().map_err(hv_err)?;
        self.devices.pause();
        let result = self.devices.states().and_then(|states| {
            self.vm_mut("snapshot")?
                .snapshot(dir, &states)
                .map_err(hv_err)
        });
        // Paused for the snapshot; run it again whatever the outcome.
        if was_running {
            self.vm_mut("snapshot")?.resume().map_err(hv_err)?;
            self.devices.resume();
        } else {
            self.state = SandboxState::Paused;
        }
        result?;
        Ok(Reply::Snapshotted {
            dir: dir.to_path_buf(),
        })
    }

    fn wait(&mut self, timeout: Duration) -> Reply {
        let deadline = Instant::now() + timeout.min(Duration::from_secs(3600));
        while self.state == SandboxState::Running && self.guest == GuestStatus::Active {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let ev = match &self.vm {
                Some(vm) => vm.next_event((deadline - now).min(Duration::from_millis(100))),
                None => break,
            };
            match ev {
                Ok(Some((_, ev))) => self.record(ev),
                Ok(None) => {}
                Err(e) => {
                    self.guest = GuestStatus::Error {
                        message: e.to_string(),
                    }
                }
            }
        }
        Reply::Guest {
            state: self.state,
            guest: self.guest.clone(),
            checkpoints: self.checkpoints.clone(),
        }
    }

    fn peek(&mut self, gpa: u64, count: u32, stride: u64) -> Result<Reply, ErrorReply> {
        if count > MAX_PEEK {
            return Err(ErrorReply::new(
                ErrorKind::BadRequest,
                format!("peek count {count} is over {MAX_PEEK}"),
            ));
        }
        let vm = self.vm_mut("peek")?;
        let values = (0..count as u64)
            .map(|i| {
                i.checked_mul(stride)
                    .and_then(|off| gpa.checked_add(off))
                    .ok_or_else(|| ErrorReply::new(ErrorKind::BadRequest, "address overflows"))
                    .and_then(|a| {
                        vm.read_u64(a)
                            .map_err(|e| ErrorReply::new(ErrorKind::BadRequest, e.to_string()))
                    })
            })
            .collect::<Result<Vec<u64>, ErrorReply>>()?;
        Ok(Reply::Values { values })
    }

    fn stats(&mut self) -> Result<Reply, ErrorReply> {
        let range = self.vm.as_ref().map(|vm| vm.host_ram_range());
        let s = stats::collect(range).map_err(|e| {
            ErrorReply::new(ErrorKind::Internal, format!("read process stats: {e}"))
        })?;
        Ok(Reply::Stats {
            state: self.state,
            guest: self.guest.clone(),
            checkpoints: self.checkpoints.clone(),
            stats: s,
        })
    }
}
