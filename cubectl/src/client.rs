//! Connecting to cube-master, and turning gRPC failures into one-line operator messages.

use crate::layout::Layout;
use cube_proto::master::v1::master_client::MasterClient;
use std::path::Path;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Code;

pub type Master = MasterClient<Channel>;

/// Where cube-master is: `--master`/`CUBE_MASTER_URL`, else the install in `--data-dir`, else the
/// default port.
pub fn master_url(explicit: Option<&str>, data_dir: &Path) -> String {
    if let Some(u) = explicit.filter(|u| !u.is_empty()) {
        return u.to_string();
    }
    match Layout::load(data_dir) {
        Ok(l) => l.master_url(),
        Err(_) => "http://127.0.0.1:9090".into(),
    }
}

/// Connects, failing fast (a few seconds) when nothing answers. `url` may list several masters,
/// comma-separated (a leader and its standbys, which do not listen): the first that answers.
pub async fn connect(url: &str) -> anyhow::Result<Master> {
    // Mutual TLS when CUBE_TLS_CA/CERT/KEY name the fleet CA and an admin certificate
    // (`deploy/install.sh --control` issues /etc/cube/pki/admin.pem).
    let tls = cube_proto::tls::from_env()?;
    for u in url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let ep = cube_proto::tls::endpoint(u, tls.as_ref())
            .map_err(|e| anyhow::anyhow!("invalid master address {u:?}: {e}"))?
            .connect_timeout(Duration::from_secs(3));
        if let Ok(ch) = ep.connect().await {
            return Ok(MasterClient::new(ch)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20));
        }
    }
    anyhow::bail!(
        "cannot reach cube-master at {url} (is it running? start it with `cubectl up`, or point --master / CUBE_MASTER_URL at it)"
    )
}

/// A gRPC error from an operation (`what`, e.g. "killing sandbox x") as one line.
pub fn status(what: &str, s: tonic::Status) -> anyhow::Error {
    let msg = match s.message().trim() {
        "" => "no details",
        m => m,
    };
    let text = match s.code() {
        Code::NotFound => format!("{what}: not found: {msg}"),
        Code::InvalidArgument => format!("{what}: invalid argument: {msg}"),
        Code::FailedPrecondition => format!("{what}: {msg}"),
        Code::Unimplemented => {
            format!("{what}: this cube-master does not implement it yet ({msg}); update it")
        }
        Code::Unavailable => format!("{what}: cube-master or the node is unavailable: {msg}"),
        Code::ResourceExhausted => format!("{what}: no capacity: {msg}"),
        Code::Unauthenticated | Code::PermissionDenied => format!("{what}: refused: {msg}"),
        Code::DeadlineExceeded => format!("{what}: timed out: {msg}"),
        c => format!("{what}: {msg} ({c:?})"),
    };
    anyhow::anyhow!(text.replace('\n', " "))
}

/// Extension: `.ctx("doing x")?` on a tonic result.
pub trait StatusExt<T> {
    fn ctx(self, what: impl AsRef<str>) -> anyhow::Result<T>;
}

impl<T> StatusExt<T> for Result<tonic::Response<T>, tonic::Status> {
    fn ctx(self, what: impl AsRef<str>) -> anyhow::Result<T> {
        self.map(|r| r.into_inner())
            .map_err(|s| status(what.as_ref(), s))
    }
}
