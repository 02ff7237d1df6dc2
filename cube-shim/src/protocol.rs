//! Wire types of the control API (version [`PROTOCOL_VERSION`]), shared with cubelet.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Version carried by every request and response (`"v"`).
pub const PROTOCOL_VERSION: u32 = 1;

/// Most u64 words one `peek` may read.
pub const MAX_PEEK: u32 = 4096;

/// A request line: `{"v":1,"op":...}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Request {
    pub v: u32,
    #[serde(flatten)]
    pub op: Op,
}

impl Request {
    pub fn new(op: Op) -> Self {
        Request {
            v: PROTOCOL_VERSION,
            op,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    Ping,
    Restore {
        snapshot: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disk: Option<PathBuf>,
        /// Tap device name (fd passing is not supported on this socket).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tap: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vsock: Option<PathBuf>,
    },
    Pause,
    PauseToDisk {
        dir: PathBuf,
    },
    Resume {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dir: Option<PathBuf>,
        /// With `dir`: the disk to attach when the paused sandbox had a virtio-blk device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disk: Option<PathBuf>,
        /// With `dir`: the tap (by name) when the paused sandbox had a virtio-net device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tap: Option<String>,
        /// With `dir`: the host socket path when the paused sandbox had a virtio-vsock device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vsock: Option<PathBuf>,
    },
    Snapshot {
        dir: PathBuf,
    },
    Stop,
    Stats,
    Wait {
        timeout_ms: u64,
    },
    Peek {
        gpa: u64,
        count: u32,
        /// Bytes between the words read (default 8: contiguous).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<u64>,
    },
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Ping => "ping",
            Op::Restore { .. } => "restore",
            Op::Pause => "pause",
            Op::PauseToDisk { .. } => "pause_to_disk",
            Op::Resume { .. } => "resume",
            Op::Snapshot { .. } => "snapshot",
            Op::Stop => "stop",
            Op::Stats => "stats",
            Op::Wait { .. } => "wait",
            Op::Peek { .. } => "peek",
        }
    }
}

/// A response line: exactly one of `ok` / `err`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Response {
    pub v: u32,
    #[serde(flatten)]
    pub body: Body,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Body {
    Ok(Reply),
    Err(ErrorReply),
}

impl Response {
    pub fn ok(reply: Reply) -> Self {
        Response {
            v: PROTOCOL_VERSION,
            body: Body::Ok(reply),
        }
    }
    pub fn err(kind: ErrorKind, message: impl Into<String>) -> Self {
        Response {
            v: PROTOCOL_VERSION,
            body: Body::Err(ErrorReply {
                kind,
                message: message.into(),
            }),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorReply {
    pub kind: ErrorKind,
    pub message: String,
}

impl ErrorReply {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ErrorReply {
            kind,
            message: message.into(),
        }
    }
}

impl From<ErrorReply> for Response {
    fn from(e: ErrorReply) -> Response {
        Response {
            v: PROTOCOL_VERSION,
            body: Body::Err(e),
        }
    }
}

/// Error classes a client can act on.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The line is not JSON / not a request object.
    Malformed,
    /// `v` is missing or not [`PROTOCOL_VERSION`].
    UnsupportedVersion,
    /// The op name is unknown, or its arguments are wrong.
    BadRequest,
    /// The op does not fit the sandbox's state (e.g. `pause` before `restore`).
    WrongState,
    /// The snapshot is missing, corrupt, or made for another shape / host.
    Snapshot,
    /// Something the protocol names but this shim does not do yet.
    Unsupported,
    /// The hypervisor or the host failed.
    Internal,
}

/// What the sandbox is doing.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// A pre-created shell waits for `restore`.
    Ready,
    Running,
    Paused,
    /// Paused to disk; the VM and its memory are gone.
    PausedToDisk,
    /// No VM and no shell (a failed restore); `resume {dir}` creates one.
    Empty,
}

/// What the guest last reported.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "guest", rename_all = "snake_case")]
pub enum GuestStatus {
    /// Nothing reported since restore / resume.
    Active,
    Done {
        code: u32,
    },
    PausePoint {
        value: u32,
    },
    Shutdown,
    Error {
        message: String,
    },
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShapeInfo {
    pub vcpus: u8,
    pub mem_mib: u32,
}

/// Memory and CPU accounting of the shim process.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Guest RAM pages resident in this process (KiB).
    pub guest_rss_kib: u64,
    /// Guest RAM pages private to this process (written or copied; KiB).
    pub guest_private_kib: u64,
    /// Proportional share of guest RAM (shared template pages split among sharers; KiB).
    pub guest_pss_kib: u64,
    /// Guest pages this process wrote (copy-on-write copies of template pages; KiB).
    pub guest_anon_kib: u64,
    /// Whole process, from `/proc/self/smaps_rollup` (KiB).
    pub process_rss_kib: u64,
    pub process_pss_kib: u64,
    pub process_private_kib: u64,
    /// User + system CPU time of the whole process (µs).
    pub cpu_user_us: u64,
    pub cpu_system_us: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    Pong {
        pid: u32,
        shape: ShapeInfo,
        state: SandboxState,
        seccomp: bool,
    },
    Restored {
        restore_us: u64,
    },
    Paused,
    PausedToDisk {
        dir: PathBuf,
    },
    Resumed,
    Snapshotted {
        dir: PathBuf,
    },
    Stopped,
    Stats {
        state: SandboxState,
        guest: GuestStatus,
        checkpoints: Vec<u32>,
        stats: Stats,
    },
    Guest {
        state: SandboxState,
        guest: GuestStatus,
        checkpoints: Vec<u32>,
    },
    Values {
        values: Vec<u64>,
    },
}

/// Parses one request line; the error is the response to send back.
pub fn parse_request(line: &str) -> Result<Request, ErrorReply> {
    let value: serde_json::Value = serde_json::from_str(line)
        .map_err(|e| ErrorReply::new(ErrorKind::Malformed, format!("not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| ErrorReply::new(ErrorKind::Malformed, "a request is a JSON object"))?;
    match obj.get("v").and_then(|v| v.as_u64()) {
        Some(v) if v == PROTOCOL_VERSION as u64 => {}
        Some(v) => {
            return Err(ErrorReply::new(
                ErrorKind::UnsupportedVersion,
                format!(
                    "protocol version {v} is not supported (this shim speaks {PROTOCOL_VERSION})"
                ),
            ))
        }
        None => {
            return Err(ErrorReply::new(
                ErrorKind::UnsupportedVersion,
                format!("missing \"v\" (this shim speaks version {PROTOCOL_VERSION})"),
            ))
        }
    }
    serde_json::from_value::<Request>(value)
        .map_err(|e| ErrorReply::new(ErrorKind::BadRequest, format!("bad request: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_look_as_documented() {
        let r = Request::new(Op::Resume {
            dir: None,
            disk: None,
            tap: None,
            vsock: None,
        });
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(s, r#"{"v":1,"op":"resume"}"#);
        assert_eq!(parse_request(&s).unwrap(), r);
        let r = parse_request(r#"{"v":1,"op":"restore","snapshot":"/t"}"#).unwrap();
        assert!(
            matches!(r.op, Op::Restore { ref snapshot, disk: None, .. } if snapshot.to_str() == Some("/t"))
        );
    }

    fn kind(line: &str) -> ErrorKind {
        match parse_request(line) {
            Err(e) => e.kind,
            other => panic!("{line}: expected an error, got {other:?}"),
        }
    }

    #[test]
    fn bad_lines_map_to_typed_errors() {
        assert_eq!(kind("garbage"), ErrorKind::Malformed);
        assert_eq!(kind("[1,2]"), ErrorKind::Malformed);
        assert_eq!(kind(r#"{"op":"ping"}"#), ErrorKind::UnsupportedVersion);
        assert_eq!(
            kind(r#"{"v":2,"op":"ping"}"#),
            ErrorKind::UnsupportedVersion
        );
        assert_eq!(kind(r#"{"v":1,"op":"fly"}"#), ErrorKind::BadRequest);
        assert_eq!(kind(r#"{"v":1,"op":"snapshot"}"#), ErrorKind::BadRequest);
        assert_eq!(
            kind(r#"{"v":1,"op":"peek","gpa":-1,"count":1}"#),
            ErrorKind::BadRequest
        );
    }

    #[test]
    fn responses_round_trip() {
        for r in [
            Response::ok(Reply::Paused),
            Response::ok(Reply::Values { values: vec![1, 2] }),
            Response::err(ErrorKind::WrongState, "no"),
        ] {
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(serde_json::from_str::<Response>(&s).unwrap(), r);
        }
        let s = serde_json::to_string(&Response::err(ErrorKind::Snapshot, "x")).unwrap();
        assert_eq!(s, r#"{"v":1,"err":{"kind":"snapshot","message":"x"}}"#);
    }
}
