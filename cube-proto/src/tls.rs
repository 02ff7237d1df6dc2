//! Mutual TLS for Cube's gRPC links (node ↔ master, api ↔ master, cubectl → master).
//!
//! Every daemon has an optional `[tls]` section with the same three paths: the fleet's CA, this
//! process's certificate and its key (PEM). Absent means plaintext, so single-host setups and the
//! test suites keep working unchanged. Present means both sides authenticate: servers require a
//! client certificate signed by the CA, clients verify the server's certificate against the CA.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig, Uri,
};

/// The `[tls]` section of `master.toml`, `api.toml`, `cubelet.toml` and cubectl's flags.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file with the CA certificate(s) that signed every certificate of the fleet.
    pub ca: PathBuf,
    /// PEM certificate (chain) of this process.
    pub cert: PathBuf,
    /// PEM private key of `cert` (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Name expected in the peer's certificate when this process is the client; empty = the
    /// host of the URL it connects to (an IP address or DNS name).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub server_name: String,
}

/// Why a TLS configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading TLS {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TLS {what} {path} holds no PEM block (expected -----BEGIN …-----)")]
    NotPem { what: &'static str, path: PathBuf },
    #[error("invalid gRPC URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("set all of CUBE_TLS_CA, CUBE_TLS_CERT and CUBE_TLS_KEY, or none")]
    Env,
    #[error(
        "refusing to serve gRPC on {addr} without mutual TLS: anyone who can reach it could \
         control this daemon. Bind a loopback address (127.0.0.1) or add a [tls] section \
         (ca, cert, key)"
    )]
    OpenPort { addr: std::net::SocketAddr },
    #[error("TLS setup for {url}: {source}")]
    Transport {
        url: String,
        source: tonic::transport::Error,
    },
}

fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let data = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    // tonic only finds out at the first handshake that a file is not PEM, and then reports an
    // opaque error on every connection: check up front so a daemon refuses to start instead.
    if !data.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(TlsError::NotPem {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(data)
}

/// tonic builds its rustls configs with the process-wide default crypto provider, which rustls
/// cannot pick by itself once another crate in the build enables a second provider (it would
/// panic at the first handshake): install ring, the one tonic's `tls` feature brings, first.
fn ensure_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err = a provider is already installed (by the binary): keep that one.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl TlsConfig {
    fn identity(&self) -> Result<Identity, TlsError> {
        Ok(Identity::from_pem(
            read_pem("certificate", &self.cert)?,
            read_pem("key", &self.key)?,
        ))
    }

    fn ca_cert(&self) -> Result<Certificate, TlsError> {
        Ok(Certificate::from_pem(read_pem("CA", &self.ca)?))
    }

    /// Server side: present our certificate and require a client certificate signed by the CA.
    pub fn server(&self) -> Result<ServerTlsConfig, TlsError> {
        ensure_provider();
        Ok(ServerTlsConfig::new()
            .identity(self.identity()?)
            .client_ca_root(self.ca_cert()?))
    }

    /// Client side: verify the server against the CA (name `server_name` or `host`) and present
    /// our certificate.
    pub fn client(&self, host: &str) -> Result<ClientTlsConfig, TlsError> {
        ensure_provider();
        let name = if self.server_name.is_empty() {
            host.trim_start_matches('[').trim_end_matches(']')
        } else {
            &self.server_name
        };
        Ok(ClientTlsConfig::new()
            .ca_certificate(self.ca_cert()?)
            .identity(self.identity()?)
            .domain_name(name))
    }
}

/// An endpoint for `url`, over mutual TLS when `tls` is set.
///
/// With TLS an `http://` URL is upgraded to `https://`: tonic would otherwise silently speak
/// plaintext to an `http` URL even with a TLS config, and the `[tls]` section states the intent.
/// Without TLS an `https://` URL is refused (there is nothing to verify the server with).
pub fn endpoint(url: &str, tls: Option<&TlsConfig>) -> Result<Endpoint, TlsError> {
    let bad = |reason: &str| TlsError::Url {
        url: url.to_string(),
        reason: reason.to_string(),
    };
    let uri = url.parse::<Uri>().map_err(|e| bad(&e.to_string()))?;
    let host = uri
        .host()
        .ok_or_else(|| bad("no host (expected http://HOST:PORT)"))?
        .to_string();
    let scheme = uri.scheme_str().unwrap_or("");
    match (tls, scheme) {
        (Some(t), "http" | "https") => {
            let rest = url.split_once("://").map_or("", |(_, r)| r);
            let url = format!("https://{rest}");
            let ep = Endpoint::from_shared(url.clone()).map_err(|e| bad(&e.to_string()))?;
            ep.tls_config(t.client(&host)?)
                .map_err(|source| TlsError::Transport { url, source })
        }
        (None, "http") => Endpoint::from_shared(url.to_string()).map_err(|e| bad(&e.to_string())),
        (None, "https") => Err(bad(
            "https:// needs a [tls] section (ca, cert, key) to authenticate the server \
             (cubectl: CUBE_TLS_CA, CUBE_TLS_CERT, CUBE_TLS_KEY)",
        )),
        _ => Err(bad("the scheme must be http:// or https://")),
    }
}

/// Client TLS from `CUBE_TLS_CA`, `CUBE_TLS_CERT`, `CUBE_TLS_KEY` (for CLIs such as cubectl):
/// `Ok(None)` when none is set, an error when only some are.
pub fn from_env() -> Result<Option<TlsConfig>, TlsError> {
    let get = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    match (
        get("CUBE_TLS_CA"),
        get("CUBE_TLS_CERT"),
        get("CUBE_TLS_KEY"),
    ) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => Ok(Some(TlsConfig {
            ca,
            cert,
            key,
            server_name: std::env::var("CUBE_TLS_SERVER_NAME").unwrap_or_default(),
        })),
        _ => Err(TlsError::Env),
    }
}

/// The rule for every gRPC server of the fleet (cubelet, cube-master): plaintext only on a
/// loopback address. Their RPCs create sandboxes, import templates from node paths and register
/// nodes, so an unauthenticated port reachable from the network is control of the host.
pub fn check_listen(addr: std::net::SocketAddr, tls: Option<&TlsConfig>) -> Result<(), TlsError> {
    if tls.is_none() && !addr.ip().is_loopback() {
        return Err(TlsError::OpenPort { addr });
    }
    Ok(())
}

/// The fleet identity of this process, set once at start from its `[tls]` section, so that every
/// gRPC client it makes (to nodes, to the master) uses it without threading the config through
/// each component. Unset or `None` = plaintext.
static PROCESS_TLS: std::sync::OnceLock<Option<TlsConfig>> = std::sync::OnceLock::new();

/// Sets the process-wide client TLS (first call wins; later calls return `false`). Validates
/// the files now so that a daemon with a broken `[tls]` section refuses to start.
pub fn set_process_tls(tls: Option<TlsConfig>) -> Result<bool, TlsError> {
    if let Some(t) = &tls {
        t.identity()?;
        t.ca_cert()?;
    }
    Ok(PROCESS_TLS.set(tls).is_ok())
}

/// The process-wide client TLS, if any.
pub fn process_tls() -> Option<&'static TlsConfig> {
    PROCESS_TLS.get().and_then(|t| t.as_ref())
}

/// [`endpoint`] with the process-wide TLS ([`set_process_tls`]).
pub fn client_endpoint(url: &str) -> Result<Endpoint, TlsError> {
    endpoint(url, process_tls())
}

/// A channel that connects on first use (the peer may start later), with a 2 s connect timeout.
pub fn connect_lazy(url: &str, tls: Option<&TlsConfig>) -> Result<Channel, TlsError> {
    Ok(endpoint(url, tls)?
        .connect_timeout(std::time::Duration::from_secs(2))
        .connect_lazy())
}

/// Connects now (for CLIs, which should fail fast with the connection error).
pub async fn connect(url: &str, tls: Option<&TlsConfig>) -> Result<Channel, TlsError> {
    endpoint(url, tls)?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .map_err(|source| TlsError::Transport {
            url: url.to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path) -> TlsConfig {
        TlsConfig {
            ca: dir.join("ca.pem"),
            cert: dir.join("c.pem"),
            key: dir.join("k.pem"),
            server_name: String::new(),
        }
    }

    #[test]
    fn missing_and_non_pem_files_are_clear_errors() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let e = c.server().unwrap_err().to_string();
        assert!(e.contains("reading TLS") && e.contains("c.pem"), "{e}");
        std::fs::write(&c.cert, "not a certificate").unwrap();
        std::fs::write(&c.key, "-----BEGIN PRIVATE KEY-----\n").unwrap();
        let e = c.server().unwrap_err().to_string();
        assert!(e.contains("no PEM block") && e.contains("c.pem"), "{e}");
    }

    #[test]
    fn plaintext_only_on_loopback() {
        let d = tempfile::tempdir().unwrap();
        let t = cfg(d.path());
        for ok in ["127.0.0.1:9091", "[::1]:9091", "127.0.0.2:1"] {
            assert!(check_listen(ok.parse().unwrap(), None).is_ok(), "{ok}");
        }
        for open in ["0.0.0.0:9091", "[::]:9091", "10.0.0.5:9091"] {
            let a = open.parse().unwrap();
            let e = check_listen(a, None).unwrap_err().to_string();
            assert!(e.contains("without mutual TLS") && e.contains(open), "{e}");
            assert!(check_listen(a, Some(&t)).is_ok(), "{open} with TLS");
        }
    }

    #[test]
    fn schemes() {
        assert!(endpoint("http://127.0.0.1:9090", None).is_ok());
        let e = endpoint("https://127.0.0.1:9090", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a [tls] section"), "{e}");
        let e = endpoint("ftp://x:1", None).unwrap_err().to_string();
        assert!(e.contains("scheme"), "{e}");
        let e = endpoint("not a url", None).unwrap_err().to_string();
        assert!(e.contains("invalid gRPC URL"), "{e}");
    }

    #[test]
    fn config_parses_and_rejects_unknown_keys() {
        let t: TlsConfig = toml::from_str("ca = \"/a\"\ncert = \"/b\"\nkey = \"/c\"\n").unwrap();
        assert_eq!(t.key, PathBuf::from("/c"));
        assert!(t.server_name.is_empty());
        assert!(
            toml::from_str::<TlsConfig>("ca = \"/a\"\ncert = \"/b\"\nkey = \"/c\"\nkye = 1\n")
                .is_err()
        );
        assert!(toml::from_str::<TlsConfig>("ca = \"/a\"\ncert = \"/b\"\n").is_err());
    }
}
