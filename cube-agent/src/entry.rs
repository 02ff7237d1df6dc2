//! `EntryInfo`: what the filesystem RPCs and watchers report about a path.

use crate::pjson;
use crate::users::Accounts;
use serde_json::{json, Map, Value};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// xattr namespace holding E2B file metadata.
pub const XATTR_PREFIX: &str = "user.e2b.";

/// Go's `FileMode.String()` for the common cases: type letter then rwx triplets.
pub fn permissions_string(mode: u32, is_dir: bool, is_symlink: bool) -> String {
    let mut s = String::with_capacity(10);
    s.push(if is_symlink {
        'L'
    } else if is_dir {
        'd'
    } else {
        '-'
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn cpath(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// Reads the `user.e2b.*` xattrs of `p` (not following a final symlink), prefix stripped.
pub fn read_metadata(p: &Path) -> Map<String, Value> {
    let mut out = Map::new();
    let Ok(c) = cpath(p) else { return out };
    let mut names = vec![0u8; 4096];
    // SAFETY: buffer pointer and length are valid.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return out;
    }
    for name in names[..n as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
    {
        let Ok(name_s) = std::str::from_utf8(name) else {
            continue;
        };
        let Some(key) = name_s.strip_prefix(XATTR_PREFIX) else {
            continue;
        };
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut val = vec![0u8; 65536];
        // SAFETY: valid C strings and buffer.
        let m = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                val.as_mut_ptr().cast(),
                val.len(),
            )
        };
        if m >= 0 {
            out.insert(
                key.to_string(),
                Value::String(String::from_utf8_lossy(&val[..m as usize]).into_owned()),
            );
        }
    }
    out
}

/// Sets one `user.e2b.<key>` xattr.
pub fn write_metadata(p: &Path, key: &str, value: &str) -> std::io::Result<()> {
    let c = cpath(p)?;
    let name = CString::new(format!("{XATTR_PREFIX}{key}"))
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad key"))?;
    // SAFETY: valid C strings and buffer.
    let rc = unsafe {
        libc::setxattr(
            c.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Builds the EntryInfo JSON for `path` (must be called with the requesting user's rights).
pub fn entry_info(path: &Path, accounts: &Accounts) -> std::io::Result<Value> {
    let lmeta = std::fs::symlink_metadata(path)?;
    let is_symlink = lmeta.file_type().is_symlink();
    let (meta, target) = if is_symlink {
        let target = std::fs::canonicalize(path)
            .or_else(|_| std::fs::read_link(path))
            .ok()
            .map(|t| t.display().to_string());
        (std::fs::metadata(path).ok(), target)
    } else {
        (Some(lmeta.clone()), None)
    };
    let m = meta.as_ref().unwrap_or(&lmeta);
    let ftype = match &meta {
        Some(m) if m.is_dir() => "FILE_TYPE_DIRECTORY",
        Some(_) => "FILE_TYPE_FILE",
        None => "FILE_TYPE_SYMLINK",
    };
    let mode = m.mode() & 0o777;
    let mtime = m.modified().unwrap_or(std::time::UNIX_EPOCH);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".into());
    let mut v = json!({
        "name": name,
        "type": ftype,
        "path": path.display().to_string(),
        "size": m.size().to_string(),
        "mode": mode,
        "permissions": permissions_string(m.mode(), m.is_dir(), false),
        "owner": accounts.user_name(lmeta.uid()),
        "group": accounts.group_name(lmeta.gid()),
        "modifiedTime": pjson::rfc3339(mtime),
        "isSymlink": is_symlink,
    });
    if let Some(t) = target {
        v["symlinkTarget"] = json!(t);
    }
    let md = read_metadata(path);
    if !md.is_empty() {
        v["metadata"] = Value::Object(md);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_strings() {
        assert_eq!(permissions_string(0o644, false, false), "-rw-r--r--");
        assert_eq!(permissions_string(0o755, true, false), "drwxr-xr-x");
        assert_eq!(permissions_string(0o777, false, true), "Lrwxrwxrwx");
    }

    #[test]
    fn entry_for_symlink_reports_target() {
        let dir = std::env::temp_dir().join(format!("cube-agent-entry-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("f"), b"hello").unwrap();
        std::os::unix::fs::symlink(dir.join("f"), dir.join("l")).unwrap();
        let acc = Accounts::load();
        let e = entry_info(&dir.join("l"), &acc).unwrap();
        assert_eq!(e["type"], "FILE_TYPE_FILE");
        assert_eq!(e["isSymlink"], true);
        assert_eq!(e["size"], "5");
        assert_eq!(e["symlinkTarget"], dir.join("f").display().to_string());
        let d = entry_info(&dir, &acc).unwrap();
        assert_eq!(d["type"], "FILE_TYPE_DIRECTORY");
        assert!(d["permissions"].as_str().unwrap().starts_with('d'));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
