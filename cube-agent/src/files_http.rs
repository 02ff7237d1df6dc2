//! `GET /files` (download) and `POST /files` (upload: multipart or raw octet-stream).

use crate::creds;
use crate::reply::{self, http_error, Body, Resp};
use crate::request::{self, ct_eq};
use crate::state::Shared;
use crate::users::User;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use tokio::sync::mpsc;

/// A gzip-encoded multipart body has to be decompressed in memory before parsing; cap it.
pub const MAX_BUFFERED_UPLOAD: usize = 256 * 1024 * 1024;
const CHUNK: usize = 64 * 1024;

/// envd's v1 signature: `v1_` + base64-nopad(sha256("path:op:user:token[:exp]")).
pub fn signature(path: &str, op: &str, user: &str, token: &str, exp: Option<&str>) -> String {
    use base64::Engine;
    let mut s = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        s.push(':');
        s.push_str(e);
    }
    let h = Sha256::digest(s.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(h)
    )
}

/// How a `/files` request was let in.
#[derive(Debug, PartialEq, Eq)]
enum Grant {
    /// No token is set, or the request carries it: any user it names.
    Token,
    /// A signed URL: exactly the user it was signed for (empty = the default user).
    Signed,
}

/// Checks the header token or the signature in the query.
fn authorize(
    state: &Shared,
    headers: &HeaderMap,
    q: &HashMap<String, String>,
    op: &str,
) -> Result<Grant, String> {
    let Some(token) = state.access_token() else {
        return Ok(Grant::Token);
    };
    if let Some(h) = headers.get("x-access-token").and_then(|v| v.to_str().ok()) {
        if ct_eq(h.as_bytes(), token.as_bytes()) {
            return Ok(Grant::Token);
        }
    }
    let Some(sig) = q.get("signature") else {
        return Err(crate::reply::UNAUTHORIZED.into());
    };
    let exp = q.get("signature_expiration").filter(|e| !e.is_empty());
    if let Some(e) = exp {
        let e: u64 = e
            .parse()
            .map_err(|_| "invalid signature expiration".to_string())?;
        if e < crate::pjson::unix_secs(std::time::SystemTime::now()) {
            return Err("signature is already expired".into());
        }
    }
    let path = q.get("path").map(String::as_str).unwrap_or("");
    let user = q.get("username").map(String::as_str).unwrap_or("");
    let want = signature(path, op, user, &token, exp.map(String::as_str));
    if ct_eq(sig.as_bytes(), want.as_bytes()) {
        Ok(Grant::Signed)
    } else {
        Err("invalid signature".into())
    }
}

fn user_for(
    state: &Shared,
    headers: &HeaderMap,
    q: &HashMap<String, String>,
    grant: Grant,
) -> Result<User, String> {
    let named = q.get("username").filter(|n| !n.is_empty());
    // A signature covers the username in the query and nothing else: an Authorization header
    // on a signed URL must not turn a default-user link into a root one.
    if grant == Grant::Signed || named.is_some() {
        return state
            .user_named(named.map_or("", String::as_str))
            .map_err(|e| e.to_string());
    }
    state
        .user_from_auth(
            headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok()),
        )
        .map_err(|e| e.to_string())
}

pub async fn handle(
    state: Shared,
    method: Method,
    headers: HeaderMap,
    q: HashMap<String, String>,
    mut body: Incoming,
) -> Resp {
    let op = if method == Method::GET {
        "read"
    } else {
        "write"
    };
    let grant = match authorize(&state, &headers, &q, op) {
        Ok(g) => g,
        Err(m) => {
            request::drain(&mut body).await;
            return http_error(401, m);
        }
    };
    let user = match user_for(&state, &headers, &q, grant) {
        Ok(u) => u,
        Err(m) => {
            request::drain(&mut body).await;
            return http_error(401, m);
        }
    };
    if method == Method::GET {
        download(state, headers, q, user).await
    } else {
        upload(state, headers, q, user, body).await
    }
}

fn wants_gzip(headers: &HeaderMap) -> Result<bool, ()> {
    let Some(ae) = headers
        .get(http::header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(false);
    };
    let mut gzip = false;
    let mut identity_ok = true;
    let mut any = false;
    for part in ae.split(',') {
        let mut it = part.trim().split(';');
        let enc = it.next().unwrap_or("").trim().to_ascii_lowercase();
        let q0 = it.any(|p| {
            let p = p.trim().replace(' ', "");
            p == "q=0" || p == "q=0.0" || p == "q=0.00" || p == "q=0.000"
        });
        match enc.as_str() {
            "gzip" | "x-gzip" if !q0 => gzip = true,
            "identity" if q0 => identity_ok = false,
            "*" if !q0 => any = true,
            _ => {}
        }
    }
    if gzip || any && !identity_ok {
        Ok(true)
    } else if identity_ok {
        Ok(false)
    } else {
        Err(())
    }
}

async fn download(
    state: Shared,
    headers: HeaderMap,
    q: HashMap<String, String>,
    user: User,
) -> Resp {
    let Some(raw) = q.get("path").filter(|p| !p.is_empty()) else {
        return http_error(400, "missing 'path' query parameter");
    };
    let gzip = match wants_gzip(&headers) {
        Ok(g) => g,
        Err(()) => {
            return http_error(
                406,
                "no acceptable content encoding (supported: identity, gzip)",
            )
        }
    };
    let path = state.resolve_path(&user, raw);
    let p2 = path.clone();
    let opened = creds::as_user(&user, move || {
        let f = std::fs::File::open(&p2)?;
        let m = f.metadata()?;
        Ok::<_, std::io::Error>((f, m))
    })
    .await;
    let disp = path.display().to_string();
    let (mut file, meta) = match opened {
        Ok(x) => x,
        Err(e) => {
            return match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENOTDIR) => {
                    http_error(404, format!("path '{disp}' does not exist"))
                }
                Some(libc::EACCES) | Some(libc::EPERM) => {
                    http_error(403, format!("permission denied for path '{disp}'"))
                }
                _ => http_error(500, format!("error opening '{disp}': {e}")),
            }
        }
    };
    if meta.is_dir() {
        return http_error(400, format!("path '{disp}' is a directory"));
    }
    // Sniff the type from the first bytes, like Go's http.ServeContent does (coarsely).
    let mut head = vec![0u8; 512];
    let (head, file) = match tokio::task::spawn_blocking(move || {
        let n = file.read(&mut head).unwrap_or(0);
        head.truncate(n);
        (head, file)
    })
    .await
    {
        Ok(x) => x,
        Err(e) => return http_error(500, format!("reading '{disp}': {e}")),
    };
    let ctype = if head.contains(&0) || std::str::from_utf8(&head).is_err() && head.len() < 509 {
        "application/octet-stream"
    } else {
        "text/plain; charset=utf-8"
    };
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let first = Bytes::from(head);
    tokio::task::spawn_blocking(move || stream_file(file, first, gzip, tx));
    let mut r = Response::new(Body::Chan(rx));
    let h = r.headers_mut();
    h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    h.insert(
        http::header::VARY,
        HeaderValue::from_static("Accept-Encoding"),
    );
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().replace('"', "\\\""))
        .unwrap_or_default();
    if let Ok(v) = HeaderValue::from_str(&format!("inline; filename=\"{name}\"")) {
        h.insert(http::header::CONTENT_DISPOSITION, v);
    }
    if gzip {
        h.insert(
            http::header::CONTENT_ENCODING,
            HeaderValue::from_static("gzip"),
        );
    } else if let Ok(v) = HeaderValue::from_str(&meta.len().to_string()) {
        h.insert(http::header::CONTENT_LENGTH, v);
    }
    *r.status_mut() = StatusCode::OK;
    r
}

/// Sends a file's bytes (optionally gzipped) into a response channel, from a blocking thread.
fn stream_file(mut file: std::fs::File, first: Bytes, gzip: bool, tx: mpsc::Sender<Bytes>) {
    let mut enc =
        gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let emit = |data: &[u8], enc: &mut Option<flate2::write::GzEncoder<Vec<u8>>>| -> bool {
        match enc {
            None => tx.blocking_send(Bytes::copy_from_slice(data)).is_ok(),
            Some(e) => {
                if e.write_all(data).is_err() {
                    return false;
                }
                let out = std::mem::take(e.get_mut());
                out.is_empty() || tx.blocking_send(Bytes::from(out)).is_ok()
            }
        }
    };
    if !first.is_empty() && !emit(&first, &mut enc) {
        return;
    }
    let mut buf = vec![0u8; CHUNK];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if !emit(&buf[..n], &mut enc) {
                    return;
                }
            }
            // The response is already under way; cutting it short is the only signal left.
            Err(_) => return,
        }
    }
    if let Some(e) = enc {
        if let Ok(out) = e.finish() {
            let _ = tx.blocking_send(Bytes::from(out));
        }
    }
}

/// An upload failure with its HTTP status.
struct UploadError(u16, String);

fn io_status(e: &std::io::Error) -> u16 {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => 507,
        Some(libc::EACCES) | Some(libc::EPERM) => 403,
        Some(libc::EISDIR)
        | Some(libc::ENOTDIR)
        | Some(libc::ENAMETOOLONG)
        | Some(libc::EINVAL) => 400,
        _ => 500,
    }
}

fn upload_io(e: std::io::Error, p: &Path) -> UploadError {
    let st = io_status(&e);
    let msg = if st == 507 {
        format!("not enough disk space to write '{}': {e}", p.display())
    } else {
        format!("error writing '{}': {e}", p.display())
    };
    UploadError(st, msg)
}

/// Writes one file from a stream of chunks, as the user, creating parent directories.
struct FileWriter {
    tx: mpsc::Sender<Bytes>,
    done: tokio::task::JoinHandle<Result<(), UploadError>>,
}

impl FileWriter {
    fn start(user: &User, path: PathBuf, gzip: bool, metadata: Vec<(String, String)>) -> Self {
        let (tx, mut rx) = mpsc::channel::<Bytes>(8);
        let user = user.clone();
        let done = tokio::task::spawn_blocking(move || {
            let _g = creds::become_user(&user).map_err(|e| UploadError(500, e.to_string()))?;
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| upload_io(e, parent))?;
            }
            if std::fs::metadata(&path)
                .map(|m| m.is_dir())
                .unwrap_or(false)
            {
                return Err(UploadError(
                    400,
                    format!("path '{}' is a directory", path.display()),
                ));
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .open(&path)
                .map_err(|e| upload_io(e, &path))?;
            // Decoder failures carry no OS error; file-system failures do.
            let gz_err = |e: std::io::Error| {
                if e.raw_os_error().is_none() {
                    UploadError(400, format!("invalid gzip body: {e}"))
                } else {
                    upload_io(e, &path)
                }
            };
            if gzip {
                let mut d = flate2::write::GzDecoder::new(f);
                while let Some(chunk) = rx.blocking_recv() {
                    d.write_all(&chunk).map_err(gz_err)?;
                }
                d.try_finish().map_err(gz_err)?;
                d.get_mut().flush().map_err(|e| upload_io(e, &path))?;
            } else {
                let mut f = f;
                while let Some(chunk) = rx.blocking_recv() {
                    f.write_all(&chunk).map_err(|e| upload_io(e, &path))?;
                }
            }
            for (k, v) in metadata {
                crate::entry::write_metadata(&path, &k, &v).map_err(|e| {
                    UploadError(
                        500,
                        format!("setting metadata {k} on '{}': {e}", path.display()),
                    )
                })?;
            }
            Ok(())
        });
        FileWriter { tx, done }
    }

    async fn write(&self, b: Bytes) -> bool {
        self.tx.send(b).await.is_ok()
    }

    async fn finish(self) -> Result<(), UploadError> {
        drop(self.tx);
        match self.done.await {
            Ok(r) => r,
            Err(e) => Err(UploadError(500, format!("writer failed: {e}"))),
        }
    }
}

fn metadata_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(k, v)| {
            let key = k.as_str().strip_prefix("x-metadata-")?;
            Some((key.to_string(), v.to_str().ok()?.to_string()))
        })
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

fn written(path: &Path) -> serde_json::Value {
    serde_json::json!({
        "path": path.display().to_string(),
        "name": path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "type": "file",
    })
}

async fn upload(
    state: Shared,
    headers: HeaderMap,
    q: HashMap<String, String>,
    user: User,
    mut body: Incoming,
) -> Resp {
    match upload_inner(&state, &headers, &q, &user, &mut body).await {
        Ok(list) => reply::json_response(200, &serde_json::Value::Array(list)),
        Err(UploadError(st, m)) => {
            // The client may still be sending (e.g. the disk filled mid-upload): swallow the
            // rest so it reads our answer instead of a reset.
            request::drain(&mut body).await;
            http_error(st, m)
        }
    }
}

async fn upload_inner<'b>(
    state: &Shared,
    headers: &HeaderMap,
    q: &HashMap<String, String>,
    user: &User,
    body: &'b mut Incoming,
) -> Result<Vec<serde_json::Value>, UploadError> {
    let ctype = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let gzip = match headers
        .get(http::header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_ascii_lowercase())
        .as_deref()
    {
        None | Some("") | Some("identity") => false,
        Some("gzip") | Some("x-gzip") => true,
        Some(other) => {
            return Err(UploadError(
                400,
                format!("unsupported Content-Encoding {other:?}"),
            ))
        }
    };
    let meta = metadata_headers(headers);
    let qpath = q.get("path").filter(|p| !p.is_empty()).cloned();

    if ctype
        .to_ascii_lowercase()
        .starts_with("multipart/form-data")
    {
        let boundary = multer::parse_boundary(&ctype)
            .map_err(|e| UploadError(400, format!("invalid multipart Content-Type: {e}")))?;
        let stream: std::pin::Pin<
            Box<dyn futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'b>,
        > = if gzip {
            let raw = request::read_body(body, MAX_BUFFERED_UPLOAD)
                .await
                .map_err(|e| UploadError(413, e.message))?;
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&raw[..])
                .take(MAX_BUFFERED_UPLOAD as u64 + 1)
                .read_to_end(&mut out)
                .map_err(|e| UploadError(400, format!("invalid gzip body: {e}")))?;
            if out.len() > MAX_BUFFERED_UPLOAD {
                return Err(UploadError(
                    413,
                    format!("decompressed multipart body exceeds {MAX_BUFFERED_UPLOAD} bytes"),
                ));
            }
            Box::pin(futures_util::stream::once(
                async move { Ok(Bytes::from(out)) },
            ))
        } else {
            Box::pin(futures_util::stream::unfold(body, |b| async move {
                loop {
                    match b.frame().await {
                        None => return None,
                        Some(Err(e)) => return Some((Err(std::io::Error::other(e)), b)),
                        Some(Ok(f)) => {
                            if let Ok(d) = f.into_data() {
                                return Some((Ok(d), b));
                            }
                        }
                    }
                }
            }))
        };
        let mut mp = multer::Multipart::new(stream, boundary);
        let mut results = Vec::new();
        let mut used_query_path = false;
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(UploadError(400, format!("invalid multipart body: {e}"))),
            };
            if field.name() != Some("file") {
                continue;
            }
            let target = if let (Some(p), false) = (&qpath, used_query_path) {
                used_query_path = true;
                p.clone()
            } else {
                match field.file_name() {
                    Some(f) if !f.is_empty() => f.to_string(),
                    _ => {
                        return Err(UploadError(
                            400,
                            "multipart part has no filename and no 'path' was given".into(),
                        ))
                    }
                }
            };
            let path = state.resolve_path(user, &target);
            let w = FileWriter::start(user, path.clone(), false, meta.clone());
            let mut field = field;
            let mut ok = true;
            loop {
                match field.chunk().await {
                    Ok(Some(c)) => {
                        if !w.write(c).await {
                            ok = false;
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let _ = w.finish().await;
                        return Err(UploadError(400, format!("invalid multipart body: {e}")));
                    }
                }
            }
            w.finish().await?;
            if !ok {
                return Err(UploadError(
                    500,
                    format!("writer for '{}' stopped", path.display()),
                ));
            }
            results.push(written(&path));
        }
        if results.is_empty() {
            return Err(UploadError(
                400,
                "no 'file' parts in the multipart body".into(),
            ));
        }
        return Ok(results);
    }

    // Raw body (application/octet-stream and anything else): `path` is required.
    let Some(p) = qpath else {
        return Err(UploadError(
            400,
            "missing 'path' query parameter for a raw upload".into(),
        ));
    };
    let path = state.resolve_path(user, &p);
    let w = FileWriter::start(user, path.clone(), gzip, meta);
    loop {
        match request::next_chunk(body).await {
            Ok(Some(c)) => {
                if !w.write(c).await {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                let _ = w.finish().await;
                return Err(UploadError(400, e.message));
            }
        }
    }
    w.finish().await?;
    Ok(vec![written(&path)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_sdk_formula() {
        // sha256("/a:read::T") base64 without padding, computed independently.
        let s = signature("/a", "read", "", "T", None);
        assert!(s.starts_with("v1_"));
        assert_eq!(s.len(), 3 + 43);
        assert_ne!(s, signature("/a", "write", "", "T", None));
        assert_ne!(s, signature("/a", "read", "", "T", Some("1")));
    }

    #[test]
    fn accept_encoding() {
        let mut h = HeaderMap::new();
        assert_eq!(wants_gzip(&h), Ok(false));
        h.insert("accept-encoding", HeaderValue::from_static("gzip, deflate"));
        assert_eq!(wants_gzip(&h), Ok(true));
        h.insert(
            "accept-encoding",
            HeaderValue::from_static("br, identity;q=0"),
        );
        assert_eq!(wants_gzip(&h), Err(()));
        h.insert("accept-encoding", HeaderValue::from_static("gzip;q=0"));
        assert_eq!(wants_gzip(&h), Ok(false));
    }
}

#[derive(serde::Deserialize)]
struct ComposeReq {
    source_paths: Vec<String>,
    destination: String,
    #[serde(default)]
    username: Option<String>,
}

/// An I/O error and the path it happened on.
struct PathErr(std::io::Error, PathBuf);

impl From<std::io::Error> for PathErr {
    fn from(e: std::io::Error) -> Self {
        PathErr(e, PathBuf::new())
    }
}

/// `POST /files/compose`: concatenates `source_paths` into `destination` (the kernel copies the
/// bytes with `copy_file_range` where it can) and returns the destination's EntryInfo.
pub async fn compose(state: Shared, headers: HeaderMap, mut body: Incoming) -> Resp {
    let raw = match request::read_body(&mut body, 1024 * 1024).await {
        Ok(b) => b,
        Err(e) => return http_error(413, e.message),
    };
    let req: ComposeReq = match serde_json::from_slice(&raw) {
        Ok(r) => r,
        Err(e) => return http_error(400, format!("invalid compose request: {e}")),
    };
    if req.source_paths.is_empty() || req.destination.is_empty() {
        return http_error(400, "source_paths and destination are required");
    }
    let mut q = HashMap::new();
    if let Some(u) = req.username {
        q.insert("username".to_string(), u);
    }
    let user = match user_for(&state, &headers, &q, Grant::Token) {
        Ok(u) => u,
        Err(m) => return http_error(401, m),
    };
    let dst = state.resolve_path(&user, &req.destination);
    let srcs: Vec<PathBuf> = req
        .source_paths
        .iter()
        .map(|s| state.resolve_path(&user, s))
        .collect();
    if srcs.contains(&dst) {
        return http_error(400, "destination must not be one of the sources");
    }
    let r = creds::as_user(&user, move || {
        let mut inputs = Vec::new();
        for s in &srcs {
            let f = std::fs::File::open(s).map_err(|e| PathErr(e, s.clone()))?;
            inputs.push(f);
        }
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(|e| PathErr(e, parent.to_path_buf()))?;
        }
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&dst)
            .map_err(|e| PathErr(e, dst.clone()))?;
        for mut f in inputs {
            std::io::copy(&mut f, &mut out).map_err(|e| PathErr(e, dst.clone()))?;
        }
        crate::entry::entry_info(&dst, &crate::users::Accounts::load())
            .map_err(|e| PathErr(e, dst.clone()))
    })
    .await;
    match r {
        Ok(v) => reply::json_response(200, &v),
        Err(PathErr(e, p)) => {
            let st = match e.raw_os_error() {
                Some(libc::ENOENT) => 404,
                _ => io_status(&e),
            };
            http_error(st, format!("compose failed at '{}': {e}", p.display()))
        }
    }
}
