//! Root filesystems from OCI images: an OCI image layout directory, or a `docker save` tarball
//! (either the classic `manifest.json` form or the OCI layout form newer Docker writes).
//! Layers are applied in order with whiteouts (`.wh.<name>` and opaque `.wh..wh..opq`).

mod beneath;
mod layer;

pub use layer::apply_layer;

use serde::Deserialize;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

/// Image configuration kept in the template manifest.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub cmd: Vec<String>,
    pub entrypoint: Vec<String>,
    pub workdir: String,
    pub user: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct DockerManifest {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize, Default)]
struct ConfigFile {
    #[serde(default)]
    config: ConfigInner,
}

#[derive(Deserialize, Default)]
struct ConfigInner {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
}

fn bad(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

fn blob(layout: &Path, digest: &str) -> std::io::Result<PathBuf> {
    let (alg, hex) = digest
        .split_once(':')
        .ok_or_else(|| bad(format!("bad digest {digest:?}")))?;
    if !hex.chars().all(|c| c.is_ascii_hexdigit()) || alg.contains('/') {
        return Err(bad(format!("bad digest {digest:?}")));
    }
    Ok(layout.join("blobs").join(alg).join(hex))
}

/// Resolves `path` (layout dir or tarball) to (config json, ordered layer files). A tarball is
/// first unpacked into `scratch`.
fn resolve(path: &Path, scratch: &Path) -> std::io::Result<(Vec<u8>, Vec<PathBuf>)> {
    let unpacked = !path.is_dir();
    let canon_scratch = if unpacked {
        std::fs::create_dir_all(scratch)?;
        Some(scratch.canonicalize()?)
    } else {
        None
    };
    // Files named by an unpacked archive must stay inside it: classic `docker save` links
    // duplicate layers with relative symlinks, but a link to a host file would pull that file
    // into the image. Nothing else writes to the scratch dir, so checking once is enough.
    let pin = |p: PathBuf| -> std::io::Result<PathBuf> {
        let Some(base) = &canon_scratch else {
            return Ok(p);
        };
        let c = p
            .canonicalize()
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
        if !c.starts_with(base) || !c.is_file() {
            return Err(bad(format!(
                "{}: points outside the archive or is not a regular file",
                p.display()
            )));
        }
        Ok(c)
    };
    let dir = if !unpacked {
        path.to_path_buf()
    } else {
        let f = std::fs::File::open(path)?;
        // The archive is as untrusted as its layers: same confined extraction.
        layer::extract_archive(f, scratch, &path.display().to_string())?;
        scratch.to_path_buf()
    };
    if dir.join("index.json").exists() {
        let idx: Index = serde_json::from_slice(&std::fs::read(pin(dir.join("index.json"))?)?)
            .map_err(|e| bad(format!("index.json: {e}")))?;
        let mut desc = idx
            .manifests
            .first()
            .ok_or_else(|| bad("index.json lists no manifests"))?;
        let mut raw = std::fs::read(pin(blob(&dir, &desc.digest)?)?)?;
        // A nested index (multi-platform): take the linux/amd64-agnostic first entry.
        let nested: Option<Index> = if desc.media_type.contains("index") {
            serde_json::from_slice(&raw).ok()
        } else {
            None
        };
        let holder;
        if let Some(n) = nested {
            holder = n;
            desc = holder
                .manifests
                .first()
                .ok_or_else(|| bad("nested index lists no manifests"))?;
            raw = std::fs::read(pin(blob(&dir, &desc.digest)?)?)?;
        }
        let m: Manifest =
            serde_json::from_slice(&raw).map_err(|e| bad(format!("manifest: {e}")))?;
        let cfg = std::fs::read(pin(blob(&dir, &m.config.digest)?)?)?;
        let layers = m
            .layers
            .iter()
            .map(|l| pin(blob(&dir, &l.digest)?))
            .collect::<std::io::Result<Vec<_>>>()?;
        return Ok((cfg, layers));
    }
    if dir.join("manifest.json").exists() {
        let ms: Vec<DockerManifest> =
            serde_json::from_slice(&std::fs::read(pin(dir.join("manifest.json"))?)?)
                .map_err(|e| bad(format!("manifest.json: {e}")))?;
        let m = ms.first().ok_or_else(|| bad("manifest.json is empty"))?;
        let safe = |p: &str| -> std::io::Result<PathBuf> {
            let pb = PathBuf::from(p);
            if pb.components().any(|c| !matches!(c, Component::Normal(_))) {
                return Err(bad(format!("unsafe path {p:?} in manifest.json")));
            }
            pin(dir.join(pb))
        };
        let cfg = std::fs::read(safe(&m.config)?)?;
        let layers = m
            .layers
            .iter()
            .map(|l| safe(l))
            .collect::<std::io::Result<Vec<_>>>()?;
        return Ok((cfg, layers));
    }
    Err(bad(format!(
        "{} is neither an OCI image layout (index.json) nor a docker save archive (manifest.json)",
        path.display()
    )))
}

fn open_layer(p: &Path) -> std::io::Result<Box<dyn Read>> {
    let mut f = std::fs::File::open(p)?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic)?;
    let f = std::fs::File::open(p)?;
    if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        return Ok(Box::new(flate2::read::GzDecoder::new(f)));
    }
    if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        return Err(bad(format!(
            "{}: zstd layers are not supported yet",
            p.display()
        )));
    }
    Ok(Box::new(f))
}

/// Unpacks the image at `path` into `root` and returns its config.
pub fn unpack_image(path: &Path, root: &Path, scratch: &Path) -> std::io::Result<ImageConfig> {
    let (cfg, layers) = resolve(path, scratch)?;
    std::fs::create_dir_all(root)?;
    for l in &layers {
        apply_layer(l, root)?;
    }
    let c: ConfigFile =
        serde_json::from_slice(&cfg).map_err(|e| bad(format!("image config: {e}")))?;
    let c = c.config;
    Ok(ImageConfig {
        env: c.env.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
        entrypoint: c.entrypoint.unwrap_or_default(),
        workdir: c.working_dir.unwrap_or_default(),
        user: c.user.unwrap_or_default(),
    })
}

/// A content hash of an image input: the tarball's bytes or the layout's index + blobs list.
pub fn image_digest(path: &Path) -> std::io::Result<String> {
    if path.is_dir() {
        crate::fstree::hash_tree(path)
    } else {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        let mut f = std::fs::File::open(path)?;
        std::io::copy(&mut f, &mut h)?;
        Ok(crate::state::hex(&h.finalize()))
    }
}

/// Builds a tiny OCI layout (for tests): layers given as lists of (path, content or None for a
/// whiteout marker file) written in order.
#[doc(hidden)]
pub fn write_test_layout(
    dir: &Path,
    layers: &[Vec<(&str, &[u8])>],
    config: &serde_json::Value,
) -> std::io::Result<()> {
    use sha2::Digest;
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    let put = |data: &[u8]| -> std::io::Result<String> {
        let h = crate::state::hex(&sha2::Sha256::digest(data));
        std::fs::write(blobs.join(&h), data)?;
        Ok(format!("sha256:{h}"))
    };
    let mut descs = Vec::new();
    for l in layers {
        let mut b = tar::Builder::new(Vec::new());
        for (p, data) in l {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, p, *data)?;
        }
        let raw = b.into_inner()?;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &raw)?;
        let d = put(&gz.finish()?)?;
        descs.push(serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": 0}));
    }
    let cfg = put(serde_json::to_vec(config)?.as_slice())?;
    let m = serde_json::json!({"schemaVersion": 2, "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": 0}, "layers": descs});
    let md = put(serde_json::to_vec(&m)?.as_slice())?;
    let idx = serde_json::json!({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": 0}]});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&idx)?)?;
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_apply_in_order_with_whiteouts() {
        let d = tempfile::tempdir().unwrap();
        let layout = d.path().join("img");
        write_test_layout(
            &layout,
            &[
                vec![("etc/a", b"1"), ("etc/b", b"2"), ("opt/x/y", b"3"), ("opt/x/z", b"4")],
                vec![("etc/.wh.a", b""), ("etc/b", b"22"), ("opt/x/.wh..wh..opq", b""), ("opt/x/new", b"5")],
            ],
            &serde_json::json!({"config": {"Env": ["A=1"], "Cmd": ["/bin/sh"], "WorkingDir": "/w", "User": "1000"}}),
        )
        .unwrap();
        let root = d.path().join("root");
        let cfg = unpack_image(&layout, &root, &d.path().join("scratch")).unwrap();
        assert!(!root.join("etc/a").exists());
        assert_eq!(std::fs::read(root.join("etc/b")).unwrap(), b"22");
        assert!(!root.join("opt/x/y").exists() && !root.join("opt/x/z").exists());
        assert_eq!(std::fs::read(root.join("opt/x/new")).unwrap(), b"5");
        assert_eq!(cfg.env, vec!["A=1"]);
        assert_eq!(cfg.cmd, vec!["/bin/sh"]);
        assert_eq!(cfg.workdir, "/w");
        assert_eq!(cfg.user, "1000");
    }

    #[test]
    fn docker_save_tarball_is_unpacked() {
        let d = tempfile::tempdir().unwrap();
        let layer = {
            let mut b = tar::Builder::new(Vec::new());
            let mut h = tar::Header::new_gnu();
            h.set_size(3);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            b.append_data(&mut h, "etc/hello", &b"hi\n"[..]).unwrap();
            b.into_inner().unwrap()
        };
        let cfg = br#"{"config": {"Env": ["PATH=/bin"], "Entrypoint": ["/entry"], "WorkingDir": "/app"}}"#;
        let manifest =
            br#"[{"Config": "cfg.json", "RepoTags": ["x:latest"], "Layers": ["abc/layer.tar"]}]"#;
        let mut outer = tar::Builder::new(Vec::new());
        for (p, data) in [
            ("manifest.json", &manifest[..]),
            ("cfg.json", &cfg[..]),
            ("abc/layer.tar", &layer[..]),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            outer.append_data(&mut h, p, data).unwrap();
        }
        let tarball = d.path().join("img.tar");
        std::fs::write(&tarball, outer.into_inner().unwrap()).unwrap();
        let root = d.path().join("root");
        let c = unpack_image(&tarball, &root, &d.path().join("scratch")).unwrap();
        assert_eq!(std::fs::read(root.join("etc/hello")).unwrap(), b"hi\n");
        assert_eq!(c.entrypoint, vec!["/entry"]);
        assert_eq!(c.workdir, "/app");
    }

    #[test]
    fn docker_save_links_must_stay_inside_the_archive() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("host-secret.json");
        std::fs::write(&outside, br#"{"config": {"Env": ["SECRET=1"]}}"#).unwrap();
        let build = |cfg_link: &str| {
            let manifest = br#"[{"Config": "cfg.json", "Layers": ["b/layer.tar"]}]"#;
            let layer = tar::Builder::new(Vec::new()).into_inner().unwrap();
            let mut outer = tar::Builder::new(Vec::new());
            for (p, data) in [
                ("manifest.json", &manifest[..]),
                ("a/layer.tar", &layer[..]),
            ] {
                let mut h = tar::Header::new_gnu();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(0);
                outer.append_data(&mut h, p, data).unwrap();
            }
            for (p, t) in [("b/layer.tar", "../a/layer.tar"), ("cfg.json", cfg_link)] {
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                h.set_mode(0o777);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(0);
                outer.append_link(&mut h, p, t).unwrap();
            }
            outer.into_inner().unwrap()
        };
        let tarball = d.path().join("img.tar");
        // Relative links inside the archive (duplicate layers) are fine...
        std::fs::write(&tarball, build("a/layer.tar")).unwrap();
        let err = unpack_image(&tarball, &d.path().join("r1"), &d.path().join("s1")).unwrap_err();
        assert!(err.to_string().contains("image config"), "{err}");
        // ...a link to a host file is not.
        std::fs::write(&tarball, build(outside.to_str().unwrap())).unwrap();
        let err = unpack_image(&tarball, &d.path().join("r2"), &d.path().join("s2")).unwrap_err();
        assert!(err.to_string().contains("outside the archive"), "{err}");
    }

    #[test]
    fn garbage_input_is_a_clear_error() {
        let d = tempfile::tempdir().unwrap();
        let err = unpack_image(d.path(), &d.path().join("r"), &d.path().join("s")).unwrap_err();
        assert!(
            err.to_string().contains("neither an OCI image layout"),
            "{err}"
        );
    }
}
