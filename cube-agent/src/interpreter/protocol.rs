//! The wire shapes of the code-interpreter protocol: request bodies, the NDJSON lines of
//! `POST /execute`, and the mapping from the worker's events (MIME bundles) to those lines.

use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// Errors in a request body.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RequestError {
    #[error("invalid JSON body: {0}")]
    Json(String),
    #[error("context_id and language are mutually exclusive")]
    ContextAndLanguage,
    #[error("unsupported language {0:?} (supported: python, bash)")]
    Language(String),
}

/// `POST /execute` body. The Python SDK sends explicit nulls, JS omits them.
#[derive(Debug, Deserialize, Default, PartialEq)]
#[serde(default)]
pub struct ExecuteRequest {
    pub code: String,
    pub context_id: Option<String>,
    pub language: Option<String>,
    pub env_vars: Option<HashMap<String, String>>,
}

/// `POST /contexts` body.
#[derive(Debug, Deserialize, Default, PartialEq)]
#[serde(default)]
pub struct CreateContextRequest {
    pub language: Option<String>,
    pub cwd: Option<String>,
}

/// Languages a context can run (both through the Python worker; bash drives a bash session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Language {
    Python,
    Bash,
}

impl Language {
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
        }
    }

    /// Parses a language name as the SDKs send it (`None`/empty = Python).
    pub fn parse(s: Option<&str>) -> Result<Language, RequestError> {
        match s.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
            None | Some("") | Some("python") | Some("python3") => Ok(Language::Python),
            Some("bash") | Some("sh") | Some("shell") => Ok(Language::Bash),
            Some(other) => Err(RequestError::Language(other.to_string())),
        }
    }
}

impl ExecuteRequest {
    pub fn parse(body: &[u8]) -> Result<ExecuteRequest, RequestError> {
        let r: ExecuteRequest =
            serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?;
        let has_ctx = r.context_id.as_deref().is_some_and(|c| !c.is_empty());
        let has_lang = r.language.as_deref().is_some_and(|l| !l.is_empty());
        if has_ctx && has_lang {
            return Err(RequestError::ContextAndLanguage);
        }
        if !has_ctx {
            Language::parse(r.language.as_deref())?;
        }
        Ok(r)
    }
}

impl CreateContextRequest {
    pub fn parse(body: &[u8]) -> Result<CreateContextRequest, RequestError> {
        if body.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(CreateContextRequest::default());
        }
        let r: CreateContextRequest =
            serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?;
        Language::parse(r.language.as_deref())?;
        Ok(r)
    }
}

/// One NDJSON line (with its `\n`).
pub fn line(v: &Value) -> bytes::Bytes {
    let mut s = v.to_string();
    s.push('\n');
    bytes::Bytes::from(s)
}

pub fn stream_line(stderr: bool, text: &str, timestamp: &str) -> Value {
    json!({"type": if stderr { "stderr" } else { "stdout" }, "text": text, "timestamp": timestamp})
}

pub fn error_line(name: &str, value: &str, traceback: &str) -> Value {
    json!({"type": "error", "name": name, "value": value, "traceback": traceback})
}

pub fn count_line(n: u64) -> Value {
    json!({"type": "number_of_executions", "execution_count": n})
}

pub fn keepalive_line() -> Value {
    json!({"type": "keepalive"})
}

pub fn end_line() -> Value {
    json!({"type": "end_of_execution"})
}

/// Maps a MIME bundle to a `result` line the way E2B's server does: known types get their
/// short key, everything else goes into `extra`; `text/plain` loses surrounding quotes.
pub fn result_line(bundle: &Map<String, Value>, is_main: bool) -> Value {
    let mut out = Map::new();
    out.insert("type".into(), json!("result"));
    let mut extra = Map::new();
    for (mime, v) in bundle {
        let key = match mime.as_str() {
            "text/plain" => {
                let t = v.as_str().map(strip_quotes).unwrap_or_default();
                out.insert("text".into(), json!(t));
                continue;
            }
            "text/html" => "html",
            "text/markdown" => "markdown",
            "image/svg+xml" => "svg",
            "image/png" => "png",
            "image/jpeg" => "jpeg",
            "application/pdf" => "pdf",
            "text/latex" => "latex",
            "application/json" => "json",
            "application/javascript" => "javascript",
            "e2b/data" => "data",
            "e2b/chart" => "chart",
            _ => {
                extra.insert(mime.clone(), v.clone());
                continue;
            }
        };
        if !v.is_null() {
            out.insert(key.into(), v.clone());
        }
    }
    if !extra.is_empty() {
        out.insert("extra".into(), Value::Object(extra));
    }
    out.insert("is_main_result".into(), json!(is_main));
    Value::Object(out)
}

/// `'abc'` → `abc`: Jupyter's text of a string result carries the repr quotes; E2B strips them.
fn strip_quotes(s: &str) -> String {
    let b = s.as_bytes();
    if b.len() >= 2 && (b[0] == b'\'' || b[0] == b'"') && b[b.len() - 1] == b[0] {
        s[1..s.len() - 1].to_string()
    } else {
        s.to_string()
    }
}

/// A message from the worker, decoded.
#[derive(Debug, PartialEq)]
pub enum WorkerMsg {
    Ready,
    Count(u64),
    Stream {
        stderr: bool,
        text: String,
    },
    Result {
        bundle: Map<String, Value>,
        main: bool,
    },
    Error {
        name: String,
        value: String,
        traceback: String,
    },
    Done,
}

/// Decodes one worker event line; returns its execution id (if any) and the message.
pub fn parse_worker_line(line: &[u8]) -> Result<(Option<u64>, WorkerMsg), String> {
    let v: Value = serde_json::from_slice(line).map_err(|e| format!("bad worker line: {e}"))?;
    let id = v.get("id").and_then(Value::as_u64);
    let s = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let msg = match v.get("type").and_then(Value::as_str) {
        Some("ready") => WorkerMsg::Ready,
        Some("count") => WorkerMsg::Count(v.get("n").and_then(Value::as_u64).unwrap_or(0)),
        Some("stdout") => WorkerMsg::Stream {
            stderr: false,
            text: s("text"),
        },
        Some("stderr") => WorkerMsg::Stream {
            stderr: true,
            text: s("text"),
        },
        Some("result") => WorkerMsg::Result {
            bundle: v
                .get("bundle")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
            main: v.get("main").and_then(Value::as_bool).unwrap_or(false),
        },
        Some("error") => WorkerMsg::Error {
            name: s("name"),
            value: s("value"),
            traceback: s("traceback"),
        },
        Some("done") => WorkerMsg::Done,
        other => return Err(format!("unknown worker event type {other:?}")),
    };
    Ok((id, msg))
}

/// The command line sent to the worker for one execution.
pub fn execute_command(
    id: u64,
    code: &str,
    env: &HashMap<String, String>,
    call_env: &HashMap<String, String>,
) -> Vec<u8> {
    let mut v = serde_json::to_vec(
        &json!({"op": "execute", "id": id, "code": code, "env": env, "call_env": call_env}),
    )
    .unwrap_or_default();
    v.push(b'\n');
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execute_request_accepts_python_and_js_sdk_shapes() {
        let py = ExecuteRequest::parse(
            br#"{"code":"1+1","context_id":null,"language":null,"env_vars":null}"#,
        )
        .unwrap();
        assert_eq!(py.code, "1+1");
        assert_eq!(py.context_id, None);
        let js = ExecuteRequest::parse(br#"{"code":"x","env_vars":{"A":"1"}}"#).unwrap();
        assert_eq!(js.env_vars.unwrap()["A"], "1");
        let ctx = ExecuteRequest::parse(br#"{"code":"x","context_id":"abc"}"#).unwrap();
        assert_eq!(ctx.context_id.as_deref(), Some("abc"));
    }

    #[test]
    fn execute_request_rejects_bad_input() {
        assert!(matches!(
            ExecuteRequest::parse(b"{not json"),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            ExecuteRequest::parse(br#"{"code": 5}"#),
            Err(RequestError::Json(_))
        ));
        assert_eq!(
            ExecuteRequest::parse(br#"{"code":"x","context_id":"a","language":"python"}"#),
            Err(RequestError::ContextAndLanguage)
        );
        assert_eq!(
            ExecuteRequest::parse(br#"{"code":"x","language":"cobol"}"#),
            Err(RequestError::Language("cobol".into()))
        );
    }

    #[test]
    fn create_context_body_is_optional() {
        assert_eq!(
            CreateContextRequest::parse(b"").unwrap(),
            CreateContextRequest::default()
        );
        let r = CreateContextRequest::parse(br#"{"language":"Python","cwd":"/tmp"}"#).unwrap();
        assert_eq!(r.cwd.as_deref(), Some("/tmp"));
        assert!(CreateContextRequest::parse(br#"{"language":"r"}"#).is_err());
        assert_eq!(Language::parse(Some("Bash")), Ok(Language::Bash));
        assert_eq!(Language::parse(None), Ok(Language::Python));
    }

    #[test]
    fn bundle_maps_to_e2b_result_keys() {
        let b: Map<String, Value> = serde_json::from_str(
            r#"{"text/plain":"'hi'","text/html":"<b>x</b>","image/png":"iVBOR",
                "application/json":{"a":1},"application/x-custom":"z"}"#,
        )
        .unwrap();
        let r = result_line(&b, true);
        assert_eq!(r["type"], "result");
        assert_eq!(r["text"], "hi");
        assert_eq!(r["html"], "<b>x</b>");
        assert_eq!(r["png"], "iVBOR");
        assert_eq!(r["json"]["a"], 1);
        assert_eq!(r["extra"]["application/x-custom"], "z");
        assert_eq!(r["is_main_result"], true);
        assert!(r.get("svg").is_none(), "absent types are omitted");
        let plain: Map<String, Value> = serde_json::from_str(r#"{"text/plain":"2"}"#).unwrap();
        let r = result_line(&plain, false);
        assert_eq!(r["text"], "2");
        assert_eq!(r["is_main_result"], false);
        assert!(r.get("extra").is_none());
    }

    #[test]
    fn quotes_are_stripped_only_when_balanced() {
        assert_eq!(strip_quotes("'a'"), "a");
        assert_eq!(strip_quotes("\"a\""), "a");
        assert_eq!(strip_quotes("'a\""), "'a\"");
        assert_eq!(strip_quotes("'"), "'");
        assert_eq!(strip_quotes("42"), "42");
    }

    #[test]
    fn lines_are_newline_terminated_json() {
        let l = line(&end_line());
        assert_eq!(&l[..], b"{\"type\":\"end_of_execution\"}\n");
        let s = stream_line(true, "oops\n", "2026-01-01T00:00:00Z");
        assert_eq!(s["type"], "stderr");
        assert_eq!(count_line(3)["execution_count"], 3);
        assert_eq!(error_line("E", "v", "tb")["name"], "E");
        assert_eq!(keepalive_line()["type"], "keepalive");
    }

    #[test]
    fn worker_lines_decode() {
        assert_eq!(
            parse_worker_line(br#"{"type":"ready","pid":7}"#).unwrap(),
            (None, WorkerMsg::Ready)
        );
        assert_eq!(
            parse_worker_line(br#"{"id":4,"type":"count","n":2}"#).unwrap(),
            (Some(4), WorkerMsg::Count(2))
        );
        assert_eq!(
            parse_worker_line(br#"{"id":4,"type":"stderr","text":"x"}"#).unwrap(),
            (
                Some(4),
                WorkerMsg::Stream {
                    stderr: true,
                    text: "x".into()
                }
            )
        );
        match parse_worker_line(
            br#"{"id":1,"type":"result","bundle":{"text/plain":"2"},"main":true}"#,
        )
        .unwrap()
        {
            (Some(1), WorkerMsg::Result { bundle, main }) => {
                assert!(main);
                assert_eq!(bundle["text/plain"], "2");
            }
            other => panic!("{other:?}"),
        }
        assert!(parse_worker_line(b"garbage").is_err());
        assert!(parse_worker_line(br#"{"type":"bogus"}"#).is_err());
    }

    #[test]
    fn command_is_one_json_line() {
        let mut env = HashMap::new();
        env.insert("A".to_string(), "1".to_string());
        let c = execute_command(9, "print(1)\nprint(2)", &env, &HashMap::new());
        assert_eq!(c.iter().filter(|b| **b == b'\n').count(), 1);
        let v: Value = serde_json::from_slice(&c).unwrap();
        assert_eq!(v["id"], 9);
        assert_eq!(v["env"]["A"], "1");
        assert_eq!(v["code"], "print(1)\nprint(2)");
    }
}
