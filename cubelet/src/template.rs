//! Templates on the node: build (debootstrap, OCI image, directory, sandbox snapshot), store,
//! resolve, list and delete.
//!
//! Layout (under the data directory):
//! ```text
//! templates/<name>/<build>/manifest.json   versioned + checksummed (see crate::state)
//! templates/<name>/<build>/rootfs.ext4
//! templates/<name>/current                 the build id new sandboxes use
//! ```
//! Builds are content addressed: the build id is derived from the recipe hash (source contents,
//! agent binary, sizes, format version), so the same inputs give the same id and are reused.

use crate::oci::ImageConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub const MANIFEST_MAGIC: &str = "cube-template-manifest";
pub const MANIFEST_VERSION: u32 = 1;
/// Bumped when the way a rootfs is assembled changes, so old builds are not reused.
const RECIPE_VERSION: u32 = 1;

/// Errors of template management.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "invalid template name {0:?}: use 1-63 of [a-z0-9._-], starting with a letter or digit"
    )]
    BadName(String),
    #[error("invalid build id {0:?}")]
    BadBuild(String),
    #[error("template {0:?} not found")]
    NotFound(String),
    #[error("template {name:?} has no build {build:?}")]
    NoBuild { name: String, build: String },
    #[error("template source: {0}")]
    Source(String),
    #[error("agent binary {path}: {source}")]
    Agent {
        path: String,
        source: std::io::Error,
    },
    #[error("template build failed: {0}")]
    Build(String),
    #[error("template manifest: {0}")]
    Manifest(#[from] crate::state::StateError),
    #[error("template {0:?} is in use by {1} sandbox(es)")]
    InUse(String, usize),
}

/// Where a rootfs comes from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    Debootstrap {
        suite: String,
        packages: Vec<String>,
        mirror: String,
    },
    Oci {
        path: PathBuf,
    },
    Directory {
        path: PathBuf,
    },
    /// A sandbox's disk (SnapshotSandbox); `disk` is a clone made by the caller.
    Snapshot {
        sandbox_id: String,
        disk: PathBuf,
    },
}

impl Source {
    pub fn kind(&self) -> &'static str {
        match self {
            Source::Debootstrap { .. } => "debootstrap",
            Source::Oci { .. } => "oci",
            Source::Directory { .. } => "directory",
            Source::Snapshot { .. } => SNAPSHOT_SOURCE,
        }
    }

    /// A remote caller's source, confined to the node's staging directory: an `oci`/`directory`
    /// path must exist and resolve (symlinks included) beneath `staging`; the result carries
    /// the resolved path, so a later swap of the named path changes nothing.
    pub fn confined(self, staging: &Path) -> Result<Source, TemplateError> {
        let confine = |path: &Path| -> Result<PathBuf, TemplateError> {
            let outside = || {
                TemplateError::Source(format!(
                    "{} is not in the node's staging directory {}: remote imports read only \
                     from there (copy or bind-mount the source into it on the node)",
                    path.display(),
                    staging.display()
                ))
            };
            if !path.is_absolute() {
                return Err(outside());
            }
            let root = std::fs::canonicalize(staging)
                .map_err(|e| TemplateError::Source(format!("{}: {e}", staging.display())))?;
            let real = std::fs::canonicalize(path).map_err(|e| {
                TemplateError::Source(format!("{} on the node: {e}", path.display()))
            })?;
            if real == root || !real.starts_with(&root) {
                return Err(outside());
            }
            Ok(real)
        };
        Ok(match self {
            Source::Oci { path } => Source::Oci {
                path: confine(&path)?,
            },
            Source::Directory { path } => Source::Directory {
                path: confine(&path)?,
            },
            other => other,
        })
    }

    /// The default `base` template: bookworm minbase with a shell, python and CA certificates.
    pub fn base() -> Source {
        Source::Debootstrap {
            suite: "bookworm".into(),
            packages: ["bash", "coreutils", "python3", "ca-certificates"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            mirror: "http://deb.debian.org/debian".into(),
        }
    }
}

/// [`Source::kind`] of a sandbox snapshot, as recorded in its manifest.
pub const SNAPSHOT_SOURCE: &str = "snapshot";

/// The default shape recorded in a manifest.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct ManifestShape {
    pub vcpus: u32,
    pub memory_mib: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RootfsInfo {
    pub file: String,
    pub sha256: String,
    pub bytes: u64,
}

/// A template build's manifest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format_version: u32,
    pub name: String,
    pub build: String,
    pub source: String,
    pub recipe_hash: String,
    /// Runtimes that can run this build. A build without a memory snapshot runs on
    /// `namespace` (and boots on `microvm`, which is not restored from it).
    pub runtimes: Vec<String>,
    pub shape: ManifestShape,
    pub rootfs: RootfsInfo,
    pub agent_sha256: String,
    /// The envd version the build's agent reports (`cube-agent --version`), which the master
    /// hands to the SDKs; empty for builds from before it was recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent_version: String,
    pub kernel_sha256: Option<String>,
    pub vmm_version: Option<String>,
    pub cpu_model_hash: Option<String>,
    /// Snapshot files (`snapshot/vmstate.bin`, `snapshot/memory.img`), absent for rootfs-only.
    pub snapshot: Option<String>,
    pub image: ImageConfig,
    pub created_at_ms: u64,
}

/// Progress of a build.
#[derive(Debug, Clone)]
pub enum BuildEvent {
    Phase(&'static str),
    Log(String),
    Reused,
    Done { bytes: u64 },
}

pub type Progress<'a> = &'a (dyn Fn(BuildEvent) + Send + Sync);

/// Creates the staging directory (see [`Source::confined`]), owned by cubelet's user and
/// closed to others (whoever can write there chooses what templates contain).
pub fn ensure_staging(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    std::fs::create_dir_all(dir)?;
    let m = std::fs::symlink_metadata(dir)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !m.is_dir() || m.uid() != me {
        return Err(std::io::Error::other(format!(
            "{} must be a directory owned by uid {me}",
            dir.display()
        )));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Validates a template name.
pub fn check_name(name: &str) -> Result<(), TemplateError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(TemplateError::BadName(name.into()))
    }
}

fn check_build(b: &str) -> Result<(), TemplateError> {
    if b.is_empty() || b.len() > 64 || !b.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(TemplateError::BadBuild(b.into()));
    }
    Ok(())
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn sha256_file(p: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut f = std::fs::File::open(p)?;
    std::io::copy(&mut f, &mut h)?;
    Ok(crate::state::hex(&h.finalize()))
}

/// The template store.
#[derive(Debug, Clone)]
pub struct TemplateStore {
    dir: PathBuf,
    cache_dir: PathBuf,
    agent_binary: PathBuf,
}

impl TemplateStore {
    pub fn new(
        dir: &Path,
        cache_dir: &Path,
        agent_binary: &Path,
    ) -> Result<TemplateStore, TemplateError> {
        std::fs::create_dir_all(dir.join(".staging"))
            .map_err(|e| TemplateError::Build(format!("mkdir {}: {e}", dir.display())))?;
        // Leftovers of builds interrupted by a crash.
        if let Ok(rd) = std::fs::read_dir(dir.join(".staging")) {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(TemplateStore {
            dir: dir.to_path_buf(),
            cache_dir: cache_dir.to_path_buf(),
            agent_binary: agent_binary.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn build_dir(&self, name: &str, build: &str) -> PathBuf {
        self.dir.join(name).join(build)
    }

    /// Reads a build's manifest and returns it with the rootfs path.
    pub fn get(
        &self,
        name: &str,
        build: Option<&str>,
    ) -> Result<(Manifest, PathBuf), TemplateError> {
        check_name(name)?;
        let build = match build.filter(|b| !b.is_empty()) {
            Some(b) => {
                check_build(b)?;
                b.to_string()
            }
            None => std::fs::read_to_string(self.dir.join(name).join("current"))
                .map(|s| s.trim().to_string())
                .map_err(|_| TemplateError::NotFound(name.into()))?,
        };
        let d = self.build_dir(name, &build);
        let mp = d.join("manifest.json");
        if !mp.exists() {
            return Err(TemplateError::NoBuild {
                name: name.into(),
                build,
            });
        }
        let m: Manifest = crate::state::read(&mp, MANIFEST_MAGIC, MANIFEST_VERSION)?;
        let rootfs = d.join(&m.rootfs.file);
        Ok((m, rootfs))
    }

    /// All builds' manifests (current builds first per name is not guaranteed).
    pub fn list(&self) -> Vec<(Manifest, bool)> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if check_name(&name).is_err() {
                continue;
            }
            let current = std::fs::read_to_string(e.path().join("current")).unwrap_or_default();
            if let Ok(bs) = std::fs::read_dir(e.path()) {
                for b in bs.flatten() {
                    let mp = b.path().join("manifest.json");
                    if let Ok(m) =
                        crate::state::read::<Manifest>(&mp, MANIFEST_MAGIC, MANIFEST_VERSION)
                    {
                        let cur = m.build == current.trim();
                        out.push((m, cur));
                    }
                }
            }
        }
        out.sort_by(|a, b| (&a.0.name, &a.0.build).cmp(&(&b.0.name, &b.0.build)));
        out
    }

    /// Deletes one build or all builds of a template. `in_use(name, build)` says how many
    /// sandboxes use a build; builds in use are refused.
    pub fn delete(
        &self,
        name: &str,
        build: Option<&str>,
        in_use: &dyn Fn(&str, &str) -> usize,
    ) -> Result<u32, TemplateError> {
        check_name(name)?;
        let tdir = self.dir.join(name);
        if !tdir.is_dir() {
            return Err(TemplateError::NotFound(name.into()));
        }
        let builds: Vec<String> = match build.filter(|b| !b.is_empty()) {
            Some(b) => {
                check_build(b)?;
                if !tdir.join(b).is_dir() {
                    return Err(TemplateError::NoBuild {
                        name: name.into(),
                        build: b.into(),
                    });
                }
                vec![b.to_string()]
            }
            None => std::fs::read_dir(&tdir)
                .map(|rd| {
                    rd.flatten()
                        .filter(|e| e.path().is_dir())
                        .map(|e| e.file_name().to_string_lossy().to_string())
                        .collect()
                })
                .unwrap_or_default(),
        };
        for b in &builds {
            let n = in_use(name, b);
            if n > 0 {
                return Err(TemplateError::InUse(format!("{name}/{b}"), n));
            }
        }
        let current = std::fs::read_to_string(tdir.join("current")).unwrap_or_default();
        for b in &builds {
            std::fs::remove_dir_all(tdir.join(b))
                .map_err(|e| TemplateError::Build(format!("delete {name}/{b}: {e}")))?;
            if current.trim() == b {
                let _ = std::fs::remove_file(tdir.join("current"));
            }
        }
        let empty = std::fs::read_dir(&tdir)
            .map(|mut r| r.next().is_none())
            .unwrap_or(false);
        if empty || build.filter(|b| !b.is_empty()).is_none() {
            let _ = std::fs::remove_dir_all(&tdir);
        }
        Ok(builds.len() as u32)
    }

    fn agent_digest(&self) -> Result<String, TemplateError> {
        sha256_file(&self.agent_binary).map_err(|e| TemplateError::Agent {
            path: self.agent_binary.display().to_string(),
            source: e,
        })
    }

    /// What the agent binary says its envd version is (`cube-agent --version` prints
    /// `cube-agent X.Y.Z`); empty, with a warning, when it cannot say.
    fn agent_version(&self) -> String {
        let out = std::process::Command::new(&self.agent_binary)
            .arg("--version")
            .output();
        match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .last()
                .unwrap_or_default()
                .to_string(),
            Ok(o) => {
                tracing::warn!(agent = %self.agent_binary.display(), status = %o.status, "agent --version failed; the build records no envd version");
                String::new()
            }
            Err(e) => {
                tracing::warn!(agent = %self.agent_binary.display(), error = %e, "agent --version failed; the build records no envd version");
                String::new()
            }
        }
    }

    /// The recipe hash: everything that determines the rootfs bytes.
    pub fn recipe_hash(&self, source: &Source, extra_mib: u64) -> Result<String, TemplateError> {
        let input = match source {
            Source::Debootstrap {
                suite,
                packages,
                mirror,
            } => {
                let mut p = packages.clone();
                p.sort();
                p.dedup();
                format!("debootstrap:{suite}:{}:{mirror}", p.join(","))
            }
            Source::Oci { path } => format!(
                "oci:{}",
                crate::oci::image_digest(path)
                    .map_err(|e| TemplateError::Source(format!("{}: {e}", path.display())))?
            ),
            Source::Directory { path } => {
                if !path.is_dir() {
                    return Err(TemplateError::Source(format!(
                        "{} is not a directory",
                        path.display()
                    )));
                }
                format!(
                    "dir:{}",
                    crate::fstree::hash_tree(path)
                        .map_err(|e| TemplateError::Source(e.to_string()))?
                )
            }
            Source::Snapshot { disk, .. } => format!(
                "snapshot:{}",
                sha256_file(disk)
                    .map_err(|e| TemplateError::Source(format!("{}: {e}", disk.display())))?
            ),
        };
        let agent = self.agent_digest()?;
        Ok(crate::state::sha256_hex(
            format!("v{RECIPE_VERSION}\n{input}\nagent:{agent}\nextra:{extra_mib}").as_bytes(),
        ))
    }

    fn set_current(&self, name: &str, build: &str) -> Result<(), TemplateError> {
        let p = self.dir.join(name).join("current");
        let tmp = self.dir.join(name).join(".current.tmp");
        std::fs::write(&tmp, build)
            .and_then(|_| std::fs::rename(&tmp, &p))
            .map_err(|e| TemplateError::Build(format!("set current of {name}: {e}")))
    }

    /// Builds (or reuses) a template; makes it the current build of `name`.
    pub fn build(
        &self,
        name: &str,
        source: &Source,
        extra_mib: u64,
        progress: Progress,
    ) -> Result<(Manifest, bool), TemplateError> {
        check_name(name)?;
        progress(BuildEvent::Phase("hashing inputs"));
        let recipe = self.recipe_hash(source, extra_mib)?;
        let build = recipe[..16].to_string();
        if let Ok((m, rootfs)) = self.get(name, Some(&build)) {
            if rootfs.exists() {
                self.set_current(name, &build)?;
                progress(BuildEvent::Reused);
                return Ok((m, true));
            }
        }
        let staging = self
            .dir
            .join(".staging")
            .join(format!("{name}-{build}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)
            .map_err(|e| TemplateError::Build(format!("mkdir staging: {e}")))?;
        let r = self.build_in(name, &build, &recipe, source, extra_mib, &staging, progress);
        let root = staging.join("root");
        if root.exists() {
            let _ = std::fs::remove_dir_all(&root);
        }
        let res = match r {
            Ok(m) => {
                let dest = self.build_dir(name, &build);
                std::fs::create_dir_all(self.dir.join(name))
                    .map_err(|e| TemplateError::Build(e.to_string()))?;
                match std::fs::rename(&staging, &dest) {
                    Ok(()) => {}
                    // A concurrent build of the same recipe won: same content, use it.
                    Err(_) if dest.join("manifest.json").exists() => {}
                    Err(e) => {
                        return Err(TemplateError::Build(format!(
                            "publish {}: {e}",
                            dest.display()
                        )))
                    }
                }
                self.set_current(name, &build)?;
                progress(BuildEvent::Done {
                    bytes: m.rootfs.bytes,
                });
                Ok((m, false))
            }
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_dir_all(&staging);
        res
    }

    #[allow(clippy::too_many_arguments)]
    fn build_in(
        &self,
        name: &str,
        build: &str,
        recipe: &str,
        source: &Source,
        extra_mib: u64,
        staging: &Path,
        progress: Progress,
    ) -> Result<Manifest, TemplateError> {
        let root = staging.join("root");
        let rootfs = staging.join("rootfs.ext4");
        let mut image = ImageConfig::default();
        let berr = |what: &str| {
            let what = what.to_string();
            move |e: std::io::Error| TemplateError::Build(format!("{what}: {e}"))
        };
        match source {
            Source::Directory { path } => {
                progress(BuildEvent::Phase("copying directory"));
                crate::fstree::copy_tree(path, &root).map_err(berr("copy directory"))?;
            }
            Source::Oci { path } => {
                progress(BuildEvent::Phase("unpacking image layers"));
                image = crate::oci::unpack_image(path, &root, &staging.join("scratch"))
                    .map_err(|e| TemplateError::Source(e.to_string()))?;
                let _ = std::fs::remove_dir_all(staging.join("scratch"));
            }
            Source::Debootstrap {
                suite,
                packages,
                mirror,
            } => {
                let cached = self.debootstrap_cached(suite, packages, mirror, progress)?;
                progress(BuildEvent::Phase("copying cached debootstrap root"));
                crate::fstree::copy_tree(&cached, &root).map_err(berr("copy cached root"))?;
            }
            Source::Snapshot { disk, .. } => {
                progress(BuildEvent::Phase("cloning sandbox disk"));
                crate::storage::clone_file(disk, &rootfs)
                    .map_err(|e| TemplateError::Build(e.to_string()))?;
            }
        }
        if !matches!(source, Source::Snapshot { .. }) {
            progress(BuildEvent::Phase("installing cube-agent"));
            install_agent(&self.agent_binary, &root)?;
            ensure_user(&root).map_err(berr("creating user"))?;
            let bytes = crate::fstree::tree_bytes(&root);
            let size = ((bytes + bytes / 4 + (64 << 20)) >> 20 << 20) + (extra_mib << 20);
            progress(BuildEvent::Phase("making ext4 image"));
            crate::storage::mkfs_ext4_from_dir(&root, &rootfs, size)
                .map_err(|e| TemplateError::Build(e.to_string()))?;
        }
        progress(BuildEvent::Phase("checksumming image"));
        let bytes = std::fs::metadata(&rootfs)
            .map_err(berr("stat rootfs"))?
            .len();
        let sha = sha256_file(&rootfs).map_err(berr("hash rootfs"))?;
        let m = Manifest {
            format_version: MANIFEST_VERSION,
            name: name.into(),
            build: build.into(),
            source: source.kind().into(),
            recipe_hash: recipe.into(),
            runtimes: vec!["namespace".into()],
            shape: ManifestShape {
                vcpus: 1,
                memory_mib: 512,
            },
            rootfs: RootfsInfo {
                file: "rootfs.ext4".into(),
                sha256: sha,
                bytes,
            },
            agent_sha256: self.agent_digest()?,
            agent_version: self.agent_version(),
            kernel_sha256: None,
            vmm_version: None,
            cpu_model_hash: None,
            snapshot: None,
            image,
            created_at_ms: now_ms(),
        };
        crate::state::write(
            &staging.join("manifest.json"),
            MANIFEST_MAGIC,
            MANIFEST_VERSION,
            &m,
        )?;
        Ok(m)
    }

    /// debootstrap into the cache (keyed by the debootstrap inputs) unless already there.
    fn debootstrap_cached(
        &self,
        suite: &str,
        packages: &[String],
        mirror: &str,
        progress: Progress,
    ) -> Result<PathBuf, TemplateError> {
        let mut p = packages.to_vec();
        p.sort();
        p.dedup();
        for x in p.iter().chain([suite.to_string()].iter()) {
            if x.is_empty()
                || !x
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-._".contains(c))
            {
                return Err(TemplateError::Source(format!(
                    "invalid debootstrap suite or package {x:?}"
                )));
            }
        }
        let key = crate::state::sha256_hex(
            format!("minbase:{suite}:{}:{mirror}", p.join(",")).as_bytes(),
        );
        let dir = self.cache_dir.join(format!("debootstrap-{}", &key[..16]));
        let root = dir.join("root");
        if dir.join("complete").exists() {
            progress(BuildEvent::Log(format!(
                "using cached debootstrap root {}",
                root.display()
            )));
            return Ok(root);
        }
        let tmp = self
            .cache_dir
            .join(format!(".tmp-{}-{}", &key[..16], std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)
            .map_err(|e| TemplateError::Build(format!("mkdir {}: {e}", tmp.display())))?;
        progress(BuildEvent::Phase("debootstrap"));
        let mut cmd = Command::new("debootstrap");
        cmd.arg("--variant=minbase");
        if !p.is_empty() {
            cmd.arg(format!("--include={}", p.join(",")));
        }
        cmd.arg(suite).arg(tmp.join("root")).arg(mirror);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| TemplateError::Build(format!("running debootstrap: {e}")))?;
        let stderr = child.stderr.take();
        let errs = std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut e) = stderr {
                let _ = std::io::Read::read_to_string(&mut e, &mut s);
            }
            s
        });
        if let Some(out) = child.stdout.take() {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                progress(BuildEvent::Log(line));
            }
        }
        let st = child
            .wait()
            .map_err(|e| TemplateError::Build(e.to_string()))?;
        let err_text = errs.join().unwrap_or_default();
        if !st.success() {
            let _ = std::fs::remove_dir_all(&tmp);
            let tail: Vec<&str> = err_text.lines().rev().take(5).collect();
            return Err(TemplateError::Build(format!(
                "debootstrap {suite} failed ({st}): {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            )));
        }
        // Keep the image small: package lists and the apt cache are not needed at run time.
        let _ = std::fs::remove_dir_all(tmp.join("root/var/cache/apt/archives"));
        let _ = std::fs::create_dir_all(tmp.join("root/var/cache/apt/archives/partial"));
        std::fs::write(tmp.join("complete"), b"")
            .map_err(|e| TemplateError::Build(e.to_string()))?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir)
            .map_err(|e| TemplateError::Build(format!("publish cache: {e}")))?;
        Ok(root)
    }
}

fn install_agent(agent: &Path, root: &Path) -> Result<(), TemplateError> {
    let sbin = root.join("sbin");
    // Debian's /sbin is a symlink to usr/sbin (merged /usr): follow it inside the root.
    let target_dir = match std::fs::read_link(&sbin) {
        Ok(t) if t.is_relative() => root.join(t),
        Ok(t) => root.join(t.strip_prefix("/").unwrap_or(&t)),
        Err(_) => sbin,
    };
    std::fs::create_dir_all(&target_dir)
        .map_err(|e| TemplateError::Build(format!("mkdir {}: {e}", target_dir.display())))?;
    let dst = target_dir.join("cube-agent");
    let _ = std::fs::remove_file(&dst);
    std::fs::copy(agent, &dst).map_err(|e| TemplateError::Agent {
        path: agent.display().to_string(),
        source: e,
    })?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| TemplateError::Build(e.to_string()))?;
    copy_missing_libs(agent, root)
        .map_err(|e| TemplateError::Build(format!("agent libraries: {e}")))?;
    Ok(())
}

/// The agent should be static; a dynamically linked (debug) build still runs when the
/// libraries `ldd` names are present, so copy the ones the root lacks from the host.
fn copy_missing_libs(bin: &Path, root: &Path) -> std::io::Result<()> {
    let Ok(out) = Command::new("ldd").arg(bin).output() else {
        return Ok(());
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        for tok in line.split_whitespace().filter(|t| t.starts_with('/')) {
            let src = Path::new(tok);
            let dst = root.join(tok.trim_start_matches('/'));
            if std::fs::symlink_metadata(&dst).is_ok() || dst.exists() {
                continue;
            }
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::copy(src.canonicalize()?, &dst)?;
        }
    }
    Ok(())
}

/// Adds the default user `user` (uid/gid 1000, home /home/user) unless present.
fn ensure_user(root: &Path) -> std::io::Result<()> {
    let etc = root.join("etc");
    std::fs::create_dir_all(&etc)?;
    let read = |f: &str| std::fs::read_to_string(etc.join(f)).unwrap_or_default();
    let append = |f: &str, line: &str| -> std::io::Result<()> {
        let mut s = read(f);
        if !s.is_empty() && !s.ends_with('\n') {
            s.push('\n');
        }
        s.push_str(line);
        s.push('\n');
        std::fs::write(etc.join(f), s)
    };
    let passwd = read("passwd");
    if !passwd.lines().any(|l| l.starts_with("root:")) {
        append("passwd", "root:x:0:0:root:/root:/bin/sh")?;
    }
    if !read("group").lines().any(|l| l.starts_with("root:")) {
        append("group", "root:x:0:")?;
    }
    if !passwd.lines().any(|l| l.starts_with("user:")) {
        let shell = if root.join("bin/bash").exists() || root.join("usr/bin/bash").exists() {
            "/bin/bash"
        } else {
            "/bin/sh"
        };
        append("passwd", &format!("user:x:1000:1000::/home/user:{shell}"))?;
        if !read("group").lines().any(|l| l.starts_with("user:")) {
            append("group", "user:x:1000:")?;
        }
        if etc.join("shadow").exists() {
            append("shadow", "user:!:19000:0:99999:7:::")?;
        }
    }
    if etc.join("sudoers.d").is_dir() {
        std::fs::write(
            etc.join("sudoers.d/user"),
            "user ALL=(ALL:ALL) NOPASSWD: ALL\n",
        )?;
    }
    let home = root.join("home/user");
    std::fs::create_dir_all(&home)?;
    std::os::unix::fs::chown(&home, Some(1000), Some(1000))?;
    for d in ["root", "tmp", "proc", "sys", "dev", "run"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777))?;
    Ok(())
}

/// Assembles a small root directory from host binaries (and the libraries `ldd` names), for
/// fast templates in tests and single-host demos: a shell and a few coreutils.
pub fn host_minimal_root(dst: &Path, programs: &[&str]) -> std::io::Result<()> {
    let mut files: Vec<PathBuf> = Vec::new();
    for p in programs {
        let path = which(p).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{p} not found on the host"),
            )
        })?;
        files.push(path.clone());
        let out = Command::new("ldd").arg(&path).output()?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            for tok in line.split_whitespace() {
                if tok.starts_with('/') {
                    files.push(PathBuf::from(tok));
                }
            }
        }
    }
    files.sort();
    files.dedup();
    // Mirror the host's merged-/usr symlinks (bin -> usr/bin, ...) so /bin/sh resolves.
    std::fs::create_dir_all(dst)?;
    for top in ["bin", "sbin", "lib", "lib64"] {
        let host = Path::new("/").join(top);
        if let Ok(t) = std::fs::read_link(&host) {
            let d = dst.join(top);
            if std::fs::symlink_metadata(&d).is_err() {
                std::os::unix::fs::symlink(&t, &d)?;
                std::fs::create_dir_all(dst.join(t.strip_prefix("/").unwrap_or(&t)))?;
            }
        }
    }
    for f in files {
        let real = f.canonicalize()?;
        let rel = f.strip_prefix("/").unwrap_or(&f);
        let d = dst.join(rel);
        if let Some(parent) = d.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if !d.exists() {
            std::fs::copy(&real, &d)?;
        }
    }
    Ok(())
}

fn which(p: &str) -> Option<PathBuf> {
    for d in ["/usr/bin", "/bin", "/usr/sbin", "/sbin"] {
        let c = Path::new(d).join(p);
        if c.exists() {
            return Some(c);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        for ok in ["base", "a", "py-3.11", "x_y"] {
            check_name(ok).unwrap();
        }
        for bad in ["", "Base", "-x", "a/b", "..", &"x".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn directory_build_is_content_addressed_and_reused() {
        cube_testkit::require_priv!("template::directory_build_is_content_addressed_and_reused");
        let d = tempfile::tempdir().unwrap();
        let agent = d.path().join("agent");
        std::fs::write(&agent, b"#!/bin/sh\n").unwrap();
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("etc")).unwrap();
        std::fs::write(src.join("etc/hello"), b"hi").unwrap();
        let store =
            TemplateStore::new(&d.path().join("templates"), &d.path().join("cache"), &agent)
                .unwrap();
        let events = std::sync::Mutex::new(Vec::new());
        let cb = |e: BuildEvent| events.lock().unwrap().push(format!("{e:?}"));
        let (m1, reused1) = store
            .build("t1", &Source::Directory { path: src.clone() }, 0, &cb)
            .unwrap();
        assert!(!reused1);
        assert!(events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains("making ext4 image")));
        let (m2, reused2) = store
            .build("t1", &Source::Directory { path: src.clone() }, 0, &cb)
            .unwrap();
        assert!(reused2);
        assert_eq!(m1.build, m2.build);
        let (got, rootfs) = store.get("t1", None).unwrap();
        assert_eq!(got, m1);
        assert!(rootfs.exists());
        assert_eq!(sha256_file(&rootfs).unwrap(), m1.rootfs.sha256);
        // A changed input is a new build.
        std::fs::write(src.join("etc/hello"), b"changed").unwrap();
        let (m3, _) = store
            .build("t1", &Source::Directory { path: src.clone() }, 0, &cb)
            .unwrap();
        assert_ne!(m3.build, m1.build);
        assert_eq!(store.get("t1", None).unwrap().0.build, m3.build);
        assert_eq!(store.list().len(), 2);
        // Tampered manifest is refused.
        let mp = store.dir().join("t1").join(&m1.build).join("manifest.json");
        let t = std::fs::read_to_string(&mp)
            .unwrap()
            .replace("directory", "directorx");
        std::fs::write(&mp, t).unwrap();
        assert!(matches!(
            store.get("t1", Some(&m1.build)),
            Err(TemplateError::Manifest(_))
        ));
        assert!(matches!(
            store.get("nope", None),
            Err(TemplateError::NotFound(_))
        ));
        assert!(matches!(
            store.delete("t1", None, &|_, b| usize::from(b == m3.build)),
            Err(TemplateError::InUse(..))
        ));
        assert_eq!(store.delete("t1", None, &|_, _| 0).unwrap(), 2);
        assert!(store.list().is_empty());
    }
}
