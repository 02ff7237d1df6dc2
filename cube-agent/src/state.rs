//! State shared by all request handlers.

use crate::process::ProcessManager;
use crate::users::{self, User};
use crate::watch::WatcherRegistry;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

/// Settings delivered by `POST /init` (and the CLI defaults).
#[derive(Debug, Clone, Default)]
pub struct Session {
    pub access_token: Option<String>,
    pub env_vars: HashMap<String, String>,
    pub default_user: String,
    pub default_workdir: Option<String>,
    pub last_init: Option<SystemTime>,
}

/// Everything the handlers share.
pub struct AgentState {
    pub session: RwLock<Session>,
    pub processes: Arc<ProcessManager>,
    pub watchers: WatcherRegistry,
    /// True when the agent does PID-1 duties; gates host-wide side effects like setting the clock.
    pub is_init: bool,
    /// Previous (total, idle) CPU jiffies for `/metrics`.
    pub cpu_sample: Mutex<Option<(u64, u64)>>,
    /// Start-up work still running (the interpreter's pre-started worker): `GET /health?warm`
    /// answers 503 until it is done, so a node pools a sandbox only once it is fully warm.
    pub warming: std::sync::atomic::AtomicUsize,
}

pub type Shared = Arc<AgentState>;

/// Why a user could not be chosen.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("invalid authorization header: {0}")]
    BadHeader(String),
    #[error("user '{0}' does not exist")]
    Unknown(String),
}

impl AgentState {
    pub fn new(default_user: String, is_init: bool) -> Shared {
        Arc::new(AgentState {
            session: RwLock::new(Session {
                default_user,
                ..Session::default()
            }),
            processes: Arc::new(ProcessManager::new()),
            watchers: WatcherRegistry::new(),
            is_init,
            cpu_sample: Mutex::new(None),
            warming: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    pub fn session(&self) -> Session {
        self.session.read().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn access_token(&self) -> Option<String> {
        self.session
            .read()
            .ok()
            .and_then(|s| s.access_token.clone())
    }

    /// Applies an init from the node (either transport): session settings unless older than
    /// the last applied one, then the clock (as init only), resolver and entropy. An unknown
    /// default user is ignored with a warning rather than failing the node's create.
    pub fn apply_init(&self, init: cube_init::Init) -> Result<(), String> {
        let ts = init.timestamp;
        {
            let Ok(mut s) = self.session.write() else {
                return Err("state lock poisoned".into());
            };
            // Newer wins: a delayed retry of an older init must not undo a newer one.
            if matches!((ts, s.last_init), (Some(new), Some(old)) if new < old) {
                tracing::info!("ignoring an init older than the last applied one");
            } else {
                if let Some(t) = ts {
                    s.last_init = Some(t);
                }
                if let Some(env) = init.env_vars {
                    s.env_vars = env.into_iter().collect();
                }
                if let Some(tok) = init.access_token {
                    s.access_token = Some(tok).filter(|t| !t.is_empty());
                }
                match init.default_user {
                    Some(name) if users::lookup(&name).is_none() => tracing::warn!(
                        "init: default user {name:?} does not exist; keeping the current one"
                    ),
                    Some(name) => s.default_user = name,
                    None => {}
                }
                if let Some(w) = init.default_workdir {
                    s.default_workdir = Some(w).filter(|w| !w.is_empty());
                }
                if let Some(t) = ts {
                    crate::init::set_clock_if_drifted(self.is_init, t);
                }
            }
        }
        if let Some(ns) = init.nameservers {
            crate::init::write_resolv_conf(Path::new(crate::init::RESOLV_CONF), &ns)?;
        }
        if let Some(bytes) = init.entropy {
            let n = bytes.len().min(crate::init::MAX_ENTROPY_BYTES);
            if let Err(e) = crate::init::add_entropy(&bytes[..n]) {
                tracing::warn!("could not add entropy: {e}");
            }
        }
        Ok(())
    }

    /// Resolves a user name (empty = the default user).
    pub fn user_named(&self, name: &str) -> Result<User, UserError> {
        let name = if name.is_empty() {
            self.session().default_user
        } else {
            name.to_string()
        };
        users::lookup(&name).ok_or(UserError::Unknown(name))
    }

    /// Resolves the user from an `Authorization: Basic base64(user:)` header, if present.
    pub fn user_from_auth(&self, header: Option<&str>) -> Result<User, UserError> {
        let Some(h) = header else {
            return self.user_named("");
        };
        let h = h.trim();
        let Some(enc) = h
            .strip_prefix("Basic ")
            .or_else(|| h.strip_prefix("basic "))
        else {
            return Err(UserError::BadHeader("expected Basic credentials".into()));
        };
        let raw = crate::pjson::unb64(enc).map_err(UserError::BadHeader)?;
        let text = String::from_utf8(raw).map_err(|_| UserError::BadHeader("not UTF-8".into()))?;
        let name = text.split(':').next().unwrap_or("");
        self.user_named(name)
    }

    /// The directory relative paths and process cwds default to for `user`.
    pub fn workdir_for(&self, user: &User) -> PathBuf {
        match self.session().default_workdir {
            Some(w) if !w.is_empty() => PathBuf::from(w),
            _ => user.home.clone(),
        }
    }

    /// Resolves a request path: `~` expands to the user's home; relative paths are relative to
    /// the user's home (envd semantics). Lexically normalised; symlinks are resolved by the kernel
    /// under the user's credentials.
    pub fn resolve_path(&self, user: &User, path: &str) -> PathBuf {
        let p = if path == "~" {
            user.home.clone()
        } else if let Some(rest) = path.strip_prefix("~/") {
            user.home.join(rest)
        } else if Path::new(path).is_absolute() {
            PathBuf::from(path)
        } else {
            user.home.join(path)
        };
        normalize(&p)
    }
}

/// Removes `.` and `..` components lexically (never above `/`).
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            std::path::Component::Normal(s) => out.push(s),
            std::path::Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both transports' inits land in the session; an older one does not undo a newer one.
    #[test]
    fn inits_apply_newest_first() {
        let st = AgentState::new("root".into(), false);
        let t = |s| Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(s));
        st.apply_init(cube_init::Init {
            env_vars: Some([("A".to_string(), "1".to_string())].into()),
            access_token: Some("tok".into()),
            default_user: Some("no-such-user-here".into()),
            default_workdir: Some("/srv".into()),
            timestamp: t(200),
            ..Default::default()
        })
        .unwrap();
        let s = st.session();
        assert_eq!(s.env_vars["A"], "1");
        assert_eq!(s.access_token.as_deref(), Some("tok"));
        assert_eq!(s.default_user, "root", "an unknown user is not taken");
        assert_eq!(s.default_workdir.as_deref(), Some("/srv"));
        st.apply_init(cube_init::Init {
            access_token: Some("old".into()),
            timestamp: t(100),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(st.access_token().as_deref(), Some("tok"));
        st.apply_init(cube_init::Init {
            access_token: Some(String::new()),
            default_workdir: Some(String::new()),
            timestamp: t(300),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(st.access_token(), None);
        assert_eq!(st.session().default_workdir, None);
    }

    #[test]
    fn normalizes() {
        assert_eq!(normalize(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
        assert_eq!(normalize(Path::new("/../..")), PathBuf::from("/"));
    }

    #[test]
    fn resolves_relative_to_home() {
        let st = AgentState::new("root".into(), false);
        let root = st.user_named("root").unwrap();
        assert_eq!(st.resolve_path(&root, "x/y"), root.home.join("x/y"));
        assert_eq!(st.resolve_path(&root, "~/z"), root.home.join("z"));
        assert_eq!(st.resolve_path(&root, "/etc/../tmp"), PathBuf::from("/tmp"));
        assert!(st.user_from_auth(Some("Basic cm9vdDo=")).is_ok());
        assert!(matches!(
            st.user_from_auth(Some("Basic bm9ib2R5LXJlYWxseS1ub3Q6")),
            Err(UserError::Unknown(_))
        ));
        assert!(st.user_from_auth(Some("Bearer x")).is_err());
    }
}
