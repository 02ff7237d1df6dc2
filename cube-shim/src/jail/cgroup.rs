//! The shim's cgroup (v2 or v1): creation, the shape's limits, joining it.

use std::path::{Path, PathBuf};

use super::JailError;

/// Limits for the shim's cgroup, derived from the shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupLimits {
    pub vcpus: u8,
    pub memory_bytes: u64,
}

fn write(path: &Path, value: &str) -> Result<(), JailError> {
    std::fs::write(path, value).map_err(|e| JailError::Cgroup {
        path: path.to_path_buf(),
        source: e,
    })
}

/// The cgroup directories `name` maps to under `root` (normally `/sys/fs/cgroup`): the
/// unified one on v2, the `cpu` and `memory` ones on v1.
pub fn cgroup_dirs(root: &Path, name: &str) -> Result<Vec<PathBuf>, JailError> {
    let rel = Path::new(name);
    if name.is_empty()
        || rel.is_absolute()
        || rel
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(JailError::CgroupName(name.to_string()));
    }
    if root.join("cgroup.controllers").exists() {
        Ok(vec![root.join(rel)])
    } else {
        // cpu and memory carry the limits; pids and freezer (when mounted) are joined too, so
        // that whoever manages the cgroup (cubelet) finds and can kill the shim in each.
        let mut v = vec![root.join("cpu").join(rel), root.join("memory").join(rel)];
        for extra in ["pids", "freezer"] {
            if root.join(extra).join("cgroup.procs").exists() {
                v.push(root.join(extra).join(rel));
            }
        }
        Ok(v)
    }
}

/// Creates (if needed) and joins cgroup `name` with `limits`. Returns the directories joined.
pub fn join_cgroup(
    root: &Path,
    name: &str,
    limits: CgroupLimits,
) -> Result<Vec<PathBuf>, JailError> {
    let dirs = cgroup_dirs(root, name)?;
    let period = 100_000u64;
    let quota = period * limits.vcpus as u64;
    for d in &dirs {
        std::fs::create_dir_all(d).map_err(|e| JailError::Cgroup {
            path: d.clone(),
            source: e,
        })?;
        if d.join("cgroup.controllers").exists() {
            write(&d.join("cpu.max"), &format!("{quota} {period}"))?;
            write(&d.join("memory.max"), &limits.memory_bytes.to_string())?;
        } else if d.join("cpu.cfs_quota_us").exists() {
            write(&d.join("cpu.cfs_period_us"), &period.to_string())?;
            write(&d.join("cpu.cfs_quota_us"), &quota.to_string())?;
        } else if d.join("memory.limit_in_bytes").exists() {
            write(
                &d.join("memory.limit_in_bytes"),
                &limits.memory_bytes.to_string(),
            )?;
        }
        write(&d.join("cgroup.procs"), &std::process::id().to_string())?;
    }
    Ok(dirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_names_are_confined() {
        let root = Path::new("/nonexistent-root");
        for bad in ["", "/abs", "../up", "a/../../b", "."] {
            assert!(cgroup_dirs(root, bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            cgroup_dirs(root, "cube/s1").unwrap(),
            vec![root.join("cpu/cube/s1"), root.join("memory/cube/s1")]
        );
    }
}
