//! `cube-shim`: one process per sandbox, hosting one VM in-process through `cube-hypervisor`.
//!
//! cubelet spawns a shim ahead of time with a shape (`--vcpus`, `--mem-mib`) and a control
//! socket path (`--socket`). The shim opens `/dev/kvm`, pre-creates a [`cube_hypervisor::VmShell`]
//! of that shape (memslot + parked vCPU threads, the slow part of VM creation), jails itself
//! ([`jail`]) and waits for requests. A `restore` then only maps the template's memory file
//! `MAP_PRIVATE` over the shell and loads vCPU/VM state. With `--template DIR` the shell is
//! also bound to that template ahead of time (memory mapped, files open and checked), so that
//! restoring it only loads vCPU/VM state.
//!
//! With `--jail-root DIR` (and `--jail-own DIR`, `--jail-bind-ro PATH`…) the shim confines
//! itself before it creates the VM ([`jail`]): a private mount namespace rooted (`pivot_root`)
//! at a tmpfs holding only its devices, its own work directory and its template; a PID
//! namespace of its own (with its own `/proc`); its own unprivileged uid with every capability
//! set empty; then seccomp with `ioctl` and `clone` argument filters. The hidden
//! `--self-test-escapes` flag is a test aid that probes that jail from inside ([`probe`]).
//! With `--build-template DIR` it does not serve: it boots the template's guest (the agent
//! stand-in, or a Linux kernel with `--kernel`) once, in the same jail when `--jail-root` is
//! given and with the seccomp filter on before the guest runs, snapshots it at its ready point
//! into `DIR` and exits ([`template`]).
//!
//! # Control API (version 1)
//! Newline-delimited JSON over the unix socket; one request line → one response line, in
//! order. Connections are served one at a time per connection thread; requests on different
//! connections are serialized by the shim. Types: [`protocol::Request`], [`protocol::Response`];
//! [`client::Client`] is a ready-made blocking client.
//!
//! Request: `{"v":1,"op":"<op>", ...args}`. Ops ([`protocol::Op`]):
//! * `ping` → `pong` (pid, shape, state).
//! * `restore` `{snapshot, disk?, tap?, vsock?}` → `restored` (µs spent). Restores the snapshot
//!   directory into the pre-created shell and runs the guest. The snapshot must match the
//!   shim's shape. Each device in the snapshot needs its backend in the request, and each
//!   backend named needs its device (else `bad_request`, the shell stays usable): virtio-blk
//!   → `disk` (the sandbox's own copy, opened read-write), virtio-net → `tap` (the name of a
//!   tap interface cubelet created in the shim's network namespace), virtio-vsock → `vsock`
//!   (the host unix socket path the shim binds; guest connections to host port P go to
//!   `<vsock>_P`). The device layout is in [`devices`].
//! * `pause` → `paused` (vCPUs stopped, memory kept). `resume` (no `dir`) runs it again.
//! * `pause_to_disk` `{dir}` → `paused_to_disk`: writes the state plus the pages that differ
//!   from the template, then **drops the VM** (guest memory is released).
//! * `resume` `{dir?, disk?, tap?, vsock?}` → `resumed`: without `dir`, from an in-memory
//!   pause; with `dir`, from a pause-to-disk directory (in this shim, or in a new shim of the
//!   same shape), with the backends for the sandbox's devices as for `restore` (they may be
//!   new ones: a new tap, a new socket path).
//! * `snapshot` `{dir}` → `snapshotted`: a full snapshot (a new template); the VM stays paused
//!   if it was paused and runs again if it was running.
//! * `stats` → `stats` ([`protocol::Stats`]): guest memory resident/private/PSS (from
//!   `/proc/self/smaps` over the guest RAM range), process RSS/PSS, CPU time, guest status.
//! * `wait` `{timeout_ms}` → `guest` status once the guest stops on its own (done, pause
//!   point, shutdown, vCPU error) or the timeout passes.
//! * `peek` `{gpa, count, stride?}` → `values`: `count` (≤ 4096) little-endian u64s of guest
//!   memory, `stride` bytes apart (default 8). Diagnostics and tests; reading faults template
//!   pages in shared, as guest reads would.
//! * `stop` → `stopped`; the VM is dropped and the shim exits after answering.
//!
//! Response: `{"v":1,"ok":{"reply":"<kind>",...}}` or
//! `{"v":1,"err":{"kind":"<ErrorKind>","message":"..."}}`. Malformed lines, unknown ops and
//! wrong versions get an error response and the connection stays usable. Nothing on a request
//! path panics.
//!
//! # Limits
//! Tap fds cannot be passed over the socket (names only). Vsock connections do not survive a
//! snapshot or pause-to-disk (the guest gets a transport reset); the guest CID and MAC do.
//! A device in a snapshot that is not in the [`devices`] layout is refused with `unsupported`.

pub mod client;
pub mod devices;
pub mod jail;
pub mod probe;
pub mod protocol;
pub mod sandbox;
pub mod server;
pub mod stats;
pub mod template;

pub use client::{Client, ClientError};
pub use protocol::{ErrorKind, Op, Reply, Request, Response, PROTOCOL_VERSION};
