//! Request defaults, applied once before a runtime sees a create: shape, user, workdir and
//! ready timeout.

use super::CreateRequest;
use crate::config::SandboxConfig;
use crate::error::NodeError;
use crate::runtime::CreateSpec;
use crate::sandbox::Shape;
use cube_init::Settings;
use std::path::Path;
use std::time::Duration;

/// The user commands run as when a create names none (E2B's default).
pub const DEFAULT_USER: &str = "user";

/// The shape a create gets: defaults filled in, checked against the node's limits; the disk
/// at least the template's image.
pub fn shape(c: &SandboxConfig, s: Shape, template_bytes: u64) -> Result<Shape, NodeError> {
    let vcpus = if s.vcpus == 0 {
        c.default_vcpus
    } else {
        s.vcpus
    };
    let memory_mib = if s.memory_mib == 0 {
        c.default_memory_mib
    } else {
        s.memory_mib
    };
    if vcpus > c.max_vcpus {
        return Err(NodeError::InvalidArgument(format!(
            "shape: {vcpus} vCPUs exceeds this node's maximum of {}",
            c.max_vcpus
        )));
    }
    if !(64..=c.max_memory_mib).contains(&memory_mib) {
        return Err(NodeError::InvalidArgument(format!(
            "shape: memory {memory_mib} MiB is outside 64..={} MiB",
            c.max_memory_mib
        )));
    }
    let min_disk = template_bytes.div_ceil(1 << 20);
    if s.disk_mib != 0 && (s.disk_mib < min_disk || s.disk_mib > c.max_disk_mib) {
        return Err(NodeError::InvalidArgument(format!("shape: disk {} MiB is outside {min_disk}..={} MiB (the template's image is {min_disk} MiB)", s.disk_mib, c.max_disk_mib)));
    }
    Ok(Shape {
        vcpus,
        memory_mib,
        disk_mib: if s.disk_mib == 0 {
            min_disk
        } else {
            s.disk_mib
        },
    })
}

/// The home directory a user's commands start in when a create names no workdir.
pub fn workdir_of(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// What a runtime is asked to create.
pub fn spec(
    c: &SandboxConfig,
    req: &CreateRequest,
    rootfs: &Path,
    template_bytes: u64,
    nameservers: &[String],
) -> CreateSpec {
    let user = if req.default_user.is_empty() {
        DEFAULT_USER.to_string()
    } else {
        req.default_user.clone()
    };
    let workdir = if req.default_workdir.is_empty() {
        workdir_of(&user)
    } else {
        req.default_workdir.clone()
    };
    CreateSpec {
        rootfs: rootfs.to_path_buf(),
        image_mib: template_bytes.div_ceil(1 << 20),
        init: Settings {
            env_vars: req.env_vars.clone(),
            access_token: Some(req.access_token.clone()).filter(|t| !t.is_empty()),
            default_user: user,
            default_workdir: workdir,
            nameservers: nameservers.to_vec(),
        },
        ready_timeout: Duration::from_millis(u64::from(if req.ready_timeout_ms == 0 {
            c.ready_timeout_ms
        } else {
            req.ready_timeout_ms
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_filled_once() {
        let c = SandboxConfig::default();
        let req = CreateRequest::default();
        let s = spec(&c, &req, Path::new("/r"), 0, &[]);
        assert_eq!(s.init.default_user, "user");
        assert!(s.init.nameservers.is_empty());
        assert_eq!(s.init.default_workdir, "/home/user");
        assert_eq!(s.init.access_token, None);
        assert_eq!(
            s.ready_timeout,
            Duration::from_millis(u64::from(c.ready_timeout_ms))
        );
        let req = CreateRequest {
            default_user: "root".into(),
            access_token: "t".into(),
            ready_timeout_ms: 5,
            ..Default::default()
        };
        let s = spec(&c, &req, Path::new("/r"), 0, &["203.0.113.53".into()]);
        assert_eq!(s.init.default_workdir, "/root");
        assert_eq!(s.init.nameservers, ["203.0.113.53"]);
        assert_eq!(s.init.access_token.as_deref(), Some("t"));
        assert_eq!(s.ready_timeout, Duration::from_millis(5));
        let req = CreateRequest {
            default_workdir: "/work".into(),
            ..Default::default()
        };
        assert_eq!(
            spec(&c, &req, Path::new("/r"), 0, &[]).init.default_workdir,
            "/work"
        );
    }

    #[test]
    fn shapes_are_checked() {
        let c = SandboxConfig::default();
        let s = shape(&c, Shape::default(), 3 << 20).unwrap();
        assert_eq!(
            (s.vcpus, s.memory_mib, s.disk_mib),
            (c.default_vcpus, c.default_memory_mib, 3)
        );
        let too_many = Shape {
            vcpus: c.max_vcpus + 1,
            ..Default::default()
        };
        assert!(matches!(
            shape(&c, too_many, 0),
            Err(NodeError::InvalidArgument(_))
        ));
        let small_disk = Shape {
            disk_mib: 1,
            ..Default::default()
        };
        assert!(shape(&c, small_disk, 3 << 20).is_err());
        let small_mem = Shape {
            memory_mib: 32,
            ..Default::default()
        };
        assert!(shape(&c, small_mem, 0).is_err());
    }
}
