//! Sandbox logs (E2B): `GET /sandboxes/{id}/logs?start&limit` (v1: `logs` lines and
//! `logEntries`) and `GET /v2/sandboxes/{id}/logs?cursor&limit&direction&level&search`
//! (`logs` entries). What the node kept: its lifecycle events (created, paused, resumed,
//! network updated, killed) and the agent's process starts and exits; also after the sandbox
//! ended, within the node's retention.

use crate::error::ApiError;
use crate::extract::{Params, SandboxId, Team};
use crate::rfc3339;
use crate::state::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cube_proto::master::v1 as pb;
use cube_proto::nodev1::{LogEntry, SandboxLogsRequest};
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// E2B's bound on `limit`.
const MAX_LIMIT: u32 = 1000;

fn timestamp(e: &LogEntry) -> String {
    rfc3339::format(i64::try_from(e.timestamp_ms).unwrap_or(i64::MAX))
}

fn entry_json(e: &LogEntry) -> Value {
    let fields: Map<String, Value> = e
        .fields
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    json!({
        "timestamp": timestamp(e),
        "level": e.level,
        "message": e.message,
        "fields": fields,
    })
}

/// The v1 `line`: the entry as one JSON log line, the way a logger writes it.
fn line_of(e: &LogEntry) -> String {
    let mut m = Map::new();
    m.insert("level".into(), Value::String(e.level.clone()));
    m.insert("msg".into(), Value::String(e.message.clone()));
    for (k, v) in &e.fields {
        m.entry(k.clone())
            .or_insert_with(|| Value::String(v.clone()));
    }
    Value::Object(m).to_string()
}

fn uint<T: std::str::FromStr>(q: &HashMap<String, String>, k: &str) -> Result<Option<T>, ApiError> {
    q.get(k)
        .map(|v| {
            v.parse::<T>()
                .map_err(|_| ApiError::bad_request(format!("{k} must be a non-negative integer")))
        })
        .transpose()
}

fn limit(q: &HashMap<String, String>) -> Result<u32, ApiError> {
    match uint::<u32>(q, "limit")? {
        None => Ok(MAX_LIMIT),
        Some(n) if n <= MAX_LIMIT => Ok(n),
        Some(_) => Err(ApiError::bad_request(format!(
            "limit must be at most {MAX_LIMIT}"
        ))),
    }
}

async fn read(
    st: &AppState,
    team: &Team,
    query: SandboxLogsRequest,
) -> Result<Vec<LogEntry>, ApiError> {
    if query.limit == 0 {
        return Ok(vec![]);
    }
    let mut m = st.master.clone();
    Ok(m.get_sandbox_logs(pb::SandboxLogsQuery {
        team_id: team.0.clone(),
        query: Some(query),
    })
    .await?
    .into_inner()
    .entries)
}

/// `GET /sandboxes/{id}/logs?start=<ms>&limit=<n>` → `{logs: [{timestamp, line}], logEntries}`.
pub(super) async fn v1(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    Params(q): Params,
) -> Result<Response, ApiError> {
    let entries = read(
        &st,
        &team,
        SandboxLogsRequest {
            sandbox_id: id,
            cursor_ms: uint::<u64>(&q, "start")?.unwrap_or(0),
            limit: limit(&q)?,
            ..Default::default()
        },
    )
    .await?;
    let logs: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({
                "timestamp": timestamp(e),
                "line": line_of(e),
            })
        })
        .collect();
    let log_entries: Vec<Value> = entries.iter().map(entry_json).collect();
    Ok(Json(json!({"logs": logs, "logEntries": log_entries})).into_response())
}

/// `GET /v2/sandboxes/{id}/logs?cursor=<ms>&limit&direction&level&search` → `{logs: [...]}`.
pub(super) async fn v2(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    Params(q): Params,
) -> Result<Response, ApiError> {
    let backward = match q.get("direction").map(String::as_str) {
        None | Some("forward") => false,
        Some("backward") => true,
        Some(d) => {
            return Err(ApiError::bad_request(format!(
                "direction must be forward or backward, not {d:?}"
            )))
        }
    };
    let min_level = q.get("level").cloned().unwrap_or_default();
    if !min_level.is_empty() && !["debug", "info", "warn", "error"].contains(&min_level.as_str()) {
        return Err(ApiError::bad_request(format!(
            "level must be one of debug, info, warn, error, not {min_level:?}"
        )));
    }
    let entries = read(
        &st,
        &team,
        SandboxLogsRequest {
            sandbox_id: id,
            cursor_ms: uint::<u64>(&q, "cursor")?.unwrap_or(0),
            limit: limit(&q)?,
            backward,
            min_level,
            search: q.get("search").cloned().unwrap_or_default(),
        },
    )
    .await?;
    let logs: Vec<Value> = entries.iter().map(entry_json).collect();
    Ok(Json(json!({ "logs": logs })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let e = LogEntry {
            timestamp_ms: 1_700_000_000_123,
            level: "warn".into(),
            message: "Process exited".into(),
            fields: [("exitCode".to_string(), "3".to_string())].into(),
        };
        let v = entry_json(&e);
        assert_eq!(v["timestamp"], "2023-11-14T22:13:20.123Z");
        assert_eq!(v["fields"]["exitCode"], "3");
        let line: Value = serde_json::from_str(&line_of(&e)).unwrap();
        assert_eq!(line["msg"], "Process exited");
        assert_eq!(line["level"], "warn");
        let q: HashMap<String, String> = [("limit".to_string(), "1001".to_string())].into();
        assert!(limit(&q).is_err());
        let q: HashMap<String, String> = [("limit".to_string(), "-1".to_string())].into();
        assert!(limit(&q).is_err());
        assert_eq!(limit(&HashMap::new()).unwrap(), MAX_LIMIT);
    }
}
