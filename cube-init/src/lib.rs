//! The init contract between a node and the agent in each of its sandboxes: what the agent is
//! told when its sandbox starts, and again after every restore from memory (a copy must not keep
//! its parent's clock, entropy or token).
//!
//! The node owns a sandbox's [`Settings`]. Two transports carry them, and the agent decodes
//! either into the same [`Init`]:
//! - HTTP `POST /init` on envd's port (namespace and gVisor sandboxes): JSON with envd's field
//!   names, [`HttpInit`];
//! - the microVM's vsock init channel, [`VsockInit`]: a microVM's agent is restored from a
//!   template snapshot, so it asks the host for its settings instead of being told them.
//!
//! Serde only (and `time` for the timestamp's RFC 3339), so the agent stays small.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

/// Largest `/init` body the agent accepts.
pub const MAX_HTTP_BODY: usize = 1 << 20;
/// Largest vsock init frame: one virtio-vsock receive buffer (4 KiB) less its 44-byte packet
/// header, so a frame is always one packet (what the microVM stand-in guest relies on too).
pub const MAX_VSOCK_FRAME: usize = 4096 - 44;
/// `"CUBI"`: the first bytes of a vsock init frame.
pub const VSOCK_MAGIC: &[u8; 4] = b"CUBI";
/// The only vsock frame version.
pub const VSOCK_VERSION: u32 = 1;
/// Bytes before a vsock frame's JSON: magic, version, clock, entropy, JSON length.
pub const VSOCK_HEADER: usize = 52;
/// Offset of the JSON length in a vsock frame (what a reader needs to know a frame is whole).
pub const VSOCK_LEN_AT: usize = 48;
/// Bytes of fresh entropy in every vsock frame.
pub const ENTROPY_BYTES: usize = 32;

/// Errors decoding or encoding an init.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum InitError {
    #[error("invalid /init body: {0}")]
    Json(String),
    #[error("invalid timestamp {0:?}: {1}")]
    Timestamp(String, String),
    #[error("invalid entropy: {0}")]
    Entropy(String),
    #[error("no CUBI header")]
    NoHeader,
    #[error("unknown init frame version {0}")]
    Version(u32),
    #[error("init JSON of {0} bytes is cut short")]
    Short(usize),
    #[error("init frame is {0} bytes; the guest takes at most {MAX_VSOCK_FRAME}")]
    TooLarge(usize),
}

/// What a sandbox's agent is told at its start and after every restore: the same each time,
/// so the node keeps it (in the sandbox's state) and resends it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default)]
pub struct Settings {
    pub env_vars: BTreeMap<String, String>,
    pub access_token: Option<String>,
    pub default_user: String,
    pub default_workdir: String,
    /// The agent writes these to `/etc/resolv.conf` (empty = leaves it alone).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
}

/// One init as the agent applies it, whichever transport carried it. `None` leaves a setting
/// as it is.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Init {
    pub env_vars: Option<BTreeMap<String, String>>,
    /// `Some("")` clears the token.
    pub access_token: Option<String>,
    pub default_user: Option<String>,
    /// `Some("")` clears the default workdir.
    pub default_workdir: Option<String>,
    /// When the node sent it: newer wins, and a restored clock is set from it.
    pub timestamp: Option<SystemTime>,
    /// Bytes to mix into the kernel RNG (a restored snapshot shares its parent's state).
    pub entropy: Option<Vec<u8>>,
    /// Written to `/etc/resolv.conf`.
    pub nameservers: Option<Vec<String>>,
}

/// The `POST /init` body (envd's field names; `entropy` and `nameservers` are Cube's).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpInit {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_workdir: Option<String>,
    /// Base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entropy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nameservers: Option<Vec<String>>,
}

impl HttpInit {
    /// The body that gives an agent `s`, sent at `now`. `clear_token`: an agent restored from
    /// another sandbox's memory holds that one's token, which an init without a token of its
    /// own must drop.
    pub fn of(s: &Settings, clear_token: bool, now: SystemTime) -> HttpInit {
        HttpInit {
            env_vars: Some(s.env_vars.clone()),
            access_token: s
                .access_token
                .clone()
                .or_else(|| clear_token.then(String::new)),
            timestamp: Some(timestamp(now)),
            default_user: Some(s.default_user.clone()),
            default_workdir: Some(s.default_workdir.clone()),
            entropy: None,
            nameservers: (!s.nameservers.is_empty()).then(|| s.nameservers.clone()),
        }
    }

    /// Decodes a request body (empty means "change nothing").
    pub fn parse(body: &[u8]) -> Result<Init, InitError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Init::default());
        }
        let h: HttpInit =
            serde_json::from_slice(body).map_err(|e| InitError::Json(e.to_string()))?;
        h.into_init()
    }

    fn into_init(self) -> Result<Init, InitError> {
        let timestamp = match self.timestamp.filter(|t| !t.is_empty()) {
            Some(t) => Some(parse_timestamp(&t)?),
            None => None,
        };
        let entropy = match self.entropy.filter(|e| !e.is_empty()) {
            Some(e) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(e.trim())
                    .map_err(|e| InitError::Entropy(e.to_string()))?,
            ),
            None => None,
        };
        Ok(Init {
            env_vars: self.env_vars,
            access_token: self.access_token,
            default_user: self.default_user.filter(|u| !u.is_empty()),
            default_workdir: self.default_workdir,
            timestamp,
            entropy,
            nameservers: self.nameservers.filter(|n| !n.is_empty()),
        })
    }
}

/// A vsock init frame: `"CUBI"`, version (u32 LE), unix time in ns (u64 LE), 32 bytes of
/// entropy, JSON length (u32 LE), JSON [`Settings`]. At most [`MAX_VSOCK_FRAME`] bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct VsockInit {
    pub clock_ns: u64,
    pub entropy: [u8; ENTROPY_BYTES],
    pub settings: Settings,
}

impl VsockInit {
    /// A frame for `settings` sent at `now` with `entropy` (fresh for every frame).
    pub fn new(settings: Settings, now: SystemTime, entropy: [u8; ENTROPY_BYTES]) -> VsockInit {
        let clock_ns = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        VsockInit {
            clock_ns,
            entropy,
            settings,
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>, InitError> {
        let json =
            serde_json::to_vec(&self.settings).map_err(|e| InitError::Json(e.to_string()))?;
        let mut v = Vec::with_capacity(VSOCK_HEADER + json.len());
        v.extend_from_slice(VSOCK_MAGIC);
        v.extend_from_slice(&VSOCK_VERSION.to_le_bytes());
        v.extend_from_slice(&self.clock_ns.to_le_bytes());
        v.extend_from_slice(&self.entropy);
        v.extend_from_slice(&(json.len() as u32).to_le_bytes());
        v.extend_from_slice(&json);
        if v.len() > MAX_VSOCK_FRAME {
            return Err(InitError::TooLarge(v.len()));
        }
        Ok(v)
    }

    /// The frame's total length once its header is in `b` (for a reader of a stream that may
    /// split it).
    pub fn frame_len(b: &[u8]) -> Option<usize> {
        let l = b.get(VSOCK_LEN_AT..VSOCK_HEADER)?;
        Some(VSOCK_HEADER + u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize)
    }

    pub fn decode(b: &[u8]) -> Result<VsockInit, InitError> {
        if b.len() < VSOCK_HEADER || &b[0..4] != VSOCK_MAGIC {
            return Err(InitError::NoHeader);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(4) != VSOCK_VERSION {
            return Err(InitError::Version(u32_at(4)));
        }
        let mut c = [0u8; 8];
        c.copy_from_slice(&b[8..16]);
        let mut entropy = [0u8; ENTROPY_BYTES];
        entropy.copy_from_slice(&b[16..16 + ENTROPY_BYTES]);
        let n = u32_at(VSOCK_LEN_AT) as usize;
        let json = b
            .get(VSOCK_HEADER..VSOCK_HEADER + n)
            .ok_or(InitError::Short(n))?;
        let settings = serde_json::from_slice(json).map_err(|e| InitError::Json(e.to_string()))?;
        Ok(VsockInit {
            clock_ns: u64::from_le_bytes(c),
            entropy,
            settings,
        })
    }

    /// What the agent applies. Authoritative for the token and workdir: a copy made for
    /// another sandbox must not keep its parent's.
    pub fn into_init(self) -> Init {
        let s = self.settings;
        Init {
            env_vars: Some(s.env_vars),
            access_token: Some(s.access_token.unwrap_or_default()),
            default_user: Some(s.default_user).filter(|u| !u.is_empty()),
            default_workdir: Some(s.default_workdir),
            timestamp: (self.clock_ns > 0)
                .then(|| SystemTime::UNIX_EPOCH + Duration::from_nanos(self.clock_ns)),
            entropy: Some(self.entropy.to_vec()),
            nameservers: Some(s.nameservers).filter(|n| !n.is_empty()),
        }
    }
}

/// RFC 3339 in UTC with as many fractional digits as needed.
pub fn timestamp(t: SystemTime) -> String {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::from(t)
        .format(&Rfc3339)
        .unwrap_or_default()
}

/// An RFC 3339 time with any offset.
pub fn parse_timestamp(s: &str) -> Result<SystemTime, InitError> {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::parse(s.trim(), &Rfc3339)
        .map(SystemTime::from)
        .map_err(|e| InitError::Timestamp(s.to_string(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            env_vars: BTreeMap::from([("A".into(), "1".into()), ("B".into(), "two".into())]),
            access_token: Some("tok".into()),
            default_user: "user".into(),
            default_workdir: "/home/user/code".into(),
            nameservers: vec!["10.0.0.1".into(), "fd00::1".into()],
        }
    }

    /// Every setting arrives the same over both transports, with a time and (vsock) entropy.
    #[test]
    fn every_field_round_trips_over_both_transports() {
        let now = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        let s = settings();
        let want = Init {
            env_vars: Some(s.env_vars.clone()),
            access_token: Some("tok".into()),
            default_user: Some("user".into()),
            default_workdir: Some("/home/user/code".into()),
            timestamp: Some(now),
            entropy: None,
            nameservers: Some(s.nameservers.clone()),
        };
        let body = serde_json::to_vec(&HttpInit::of(&s, false, now)).unwrap();
        assert_eq!(HttpInit::parse(&body).unwrap(), want);

        let frame = VsockInit::new(s.clone(), now, [7; ENTROPY_BYTES]);
        let enc = frame.encode().unwrap();
        assert_eq!(VsockInit::frame_len(&enc), Some(enc.len()));
        let dec = VsockInit::decode(&enc).unwrap();
        assert_eq!(dec, frame);
        assert_eq!(
            dec.into_init(),
            Init {
                entropy: Some(vec![7; ENTROPY_BYTES]),
                ..want
            }
        );
    }

    #[test]
    fn http_entropy_and_offsets_decode() {
        let i = HttpInit::parse(
            br#"{"timestamp":"2024-01-01T02:00:00+02:00","entropy":"AAEC","defaultUser":""}"#,
        )
        .unwrap();
        assert_eq!(
            i.timestamp,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_704_067_200))
        );
        assert_eq!(i.entropy, Some(vec![0, 1, 2]));
        assert_eq!(i.default_user, None, "an empty user keeps the current one");
        assert_eq!(HttpInit::parse(b" \n").unwrap(), Init::default());
        assert!(matches!(
            HttpInit::parse(br#"{"timestamp":"yesterday"}"#),
            Err(InitError::Timestamp(..))
        ));
        assert!(matches!(
            HttpInit::parse(br#"{"entropy":"!!"}"#),
            Err(InitError::Entropy(_))
        ));
        assert!(matches!(HttpInit::parse(b"["), Err(InitError::Json(_))));
    }

    /// A copy made for a sandbox without a token must not keep its parent's.
    #[test]
    fn tokens_are_cleared_not_inherited() {
        let s = Settings {
            access_token: None,
            ..settings()
        };
        let now = SystemTime::now();
        let h = HttpInit::of(&s, true, now);
        assert_eq!(h.access_token.as_deref(), Some(""));
        assert_eq!(HttpInit::of(&s, false, now).access_token, None);
        let v = VsockInit::new(s, now, [0; ENTROPY_BYTES]).into_init();
        assert_eq!(v.access_token.as_deref(), Some(""));
    }

    #[test]
    fn bad_and_oversized_frames_are_refused() {
        let enc = VsockInit::new(settings(), SystemTime::now(), [1; ENTROPY_BYTES])
            .encode()
            .unwrap();
        assert_eq!(VsockInit::decode(b"CUBI"), Err(InitError::NoHeader));
        let mut p = enc.clone();
        p[4] = 2;
        assert_eq!(VsockInit::decode(&p), Err(InitError::Version(2)));
        let mut p = enc.clone();
        p.truncate(p.len() - 2);
        assert!(matches!(VsockInit::decode(&p), Err(InitError::Short(_))));
        let mut p = enc.clone();
        p[0] = b'X';
        assert_eq!(VsockInit::decode(&p), Err(InitError::NoHeader));
        let big = Settings {
            env_vars: BTreeMap::from([("X".into(), "x".repeat(MAX_VSOCK_FRAME))]),
            ..Settings::default()
        };
        assert!(matches!(
            VsockInit::new(big, SystemTime::now(), [0; ENTROPY_BYTES]).encode(),
            Err(InitError::TooLarge(_))
        ));
    }

    /// A node's persisted settings (its state file) read back unchanged, and older files
    /// without `nameservers` still read.
    #[test]
    fn settings_keep_their_stored_shape() {
        let s = settings();
        let back: Settings = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        let old: Settings = serde_json::from_str(
            r#"{"env_vars":{},"access_token":null,"default_user":"root","default_workdir":""}"#,
        )
        .unwrap();
        assert_eq!(old.default_user, "root");
        assert!(old.nameservers.is_empty());
    }

    #[test]
    fn timestamps_format_and_parse() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 5_000_000);
        assert_eq!(timestamp(t), "2023-11-14T22:13:20.005Z");
        assert_eq!(parse_timestamp(&timestamp(t)).unwrap(), t);
    }
}
