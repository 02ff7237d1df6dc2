//! In-sandbox agent: PID 1 and the E2B envd protocol on port 49983.
//!
//! The binary (`src/main.rs`) wires these modules together; they live in a library so that unit
//! tests can reach the parsers without running as PID 1.

pub mod config;
pub mod connect;
pub mod creds;
pub mod entry;
pub mod files_http;
pub mod fs_rpc;
pub mod init;
pub mod interpreter;
pub mod journal;
pub mod listen;
pub mod mountinfo;
pub mod net;
pub mod pjson;
pub mod process;
pub mod process_rpc;
pub mod reaper;
pub mod reply;
pub mod request;
pub mod server;
pub mod state;
pub mod sys_http;
pub mod users;
pub mod version;
pub mod vsock_init;
pub mod watch;
