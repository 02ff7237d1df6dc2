//! Sandbox metrics (E2B §2.3): `GET /sandboxes/{id}/metrics` (the SDK's `get_metrics()`) and
//! `GET /sandboxes/metrics?sandbox_ids=a,b` (dashboard/CLI): the first is the history its node
//! sampled, the second one fresh sample of each running sandbox.

use crate::error::ApiError;
use crate::extract::{check_id, Params, SandboxId, Team};
use crate::rfc3339;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cube_proto::master::v1 as pb;
use cube_proto::nodev1::{SandboxMetricsRequest, SandboxStatsResponse};
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// Most ids one `GET /sandboxes/metrics` may ask for.
const MAX_IDS: usize = 100;

/// The `SandboxMetric` object.
pub fn metric_json(s: &SandboxStatsResponse) -> Value {
    let ms = i64::try_from(s.timestamp_ms).unwrap_or(i64::MAX);
    json!({
        "timestamp": rfc3339::format(ms),
        "timestampUnix": ms / 1000,
        "cpuCount": s.cpu_count,
        "cpuUsedPct": s.cpu_used_pct,
        "memUsed": s.mem_used_bytes,
        "memTotal": s.mem_total_bytes,
        "memCache": s.mem_cache_bytes,
        "diskUsed": s.disk_used_bytes,
        "diskTotal": s.disk_total_bytes,
    })
}

fn unix_param(q: &HashMap<String, String>, k: &str) -> Result<Option<i64>, ApiError> {
    match q.get(k) {
        None => Ok(None),
        Some(v) => match v.parse::<i64>() {
            Ok(t) if t >= 0 => Ok(Some(t)),
            _ => Err(ApiError::bad_request(format!(
                "{k} must be a unix time in seconds"
            ))),
        },
    }
}

/// One sample, or none when the sandbox is paused (no CPU, memory on disk).
async fn sample(
    st: &AppState,
    team: &Team,
    id: &str,
) -> Result<Option<SandboxStatsResponse>, ApiError> {
    let mut m = st.master.clone();
    match m
        .get_sandbox_metrics(pb::SandboxRef {
            team_id: team.0.clone(),
            sandbox_id: id.to_string(),
        })
        .await
    {
        Ok(r) => Ok(Some(r.into_inner())),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => Ok(None),
        Err(s) => Err(s.into()),
    }
}

/// `GET /sandboxes/{id}/metrics?start=&end=` → 200 `[SandboxMetric]`: the samples its node
/// took in the window (seconds, inclusive), oldest first; a running sandbox's include one of
/// the last second. Paused and ended sandboxes keep theirs (within the node's retention).
pub(super) async fn one(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    Params(q): Params,
) -> Result<Response, ApiError> {
    let start = unix_param(&q, "start")?;
    let end = unix_param(&q, "end")?;
    if let (Some(s), Some(e)) = (start, end) {
        if e < s {
            return Err(ApiError::bad_request("end must not be before start"));
        }
    }
    let ms = |s: i64| u64::try_from(s).unwrap_or(0).saturating_mul(1000);
    let mut m = st.master.clone();
    let r = m
        .get_sandbox_metrics_history(pb::SandboxMetricsQuery {
            team_id: team.0.clone(),
            query: Some(SandboxMetricsRequest {
                sandbox_id: id,
                start_ms: start.map(ms).unwrap_or(0),
                // The whole last second; 0 would mean unbounded.
                end_ms: end.map(|e| ms(e).saturating_add(999)).unwrap_or(0),
            }),
        })
        .await?
        .into_inner();
    let out: Vec<Value> = r.samples.iter().map(metric_json).collect();
    Ok(Json(Value::Array(out)).into_response())
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b` → 200 `{"sandboxes": {id: SandboxMetric}}`;
/// unknown or paused ids are left out.
pub(super) async fn many(
    State(st): State<AppState>,
    team: Team,
    Params(q): Params,
) -> Result<Response, ApiError> {
    let Some(raw) = q.get("sandbox_ids") else {
        return Err(ApiError::bad_request("sandbox_ids is required"));
    };
    let mut ids: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() || ids.len() > MAX_IDS {
        return Err(ApiError::bad_request(format!(
            "sandbox_ids must name 1 to {MAX_IDS} sandboxes"
        )));
    }
    // One after another: each is a quick read on its node, and the list is bounded.
    let mut sandboxes = Map::new();
    for id in ids {
        if check_id(id).is_err() {
            continue;
        }
        match sample(&st, &team, id).await {
            Ok(Some(s)) => {
                sandboxes.insert(id.to_string(), metric_json(&s));
            }
            Ok(None) => {}
            Err(e) if e.status == StatusCode::NOT_FOUND => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Json(json!({ "sandboxes": sandboxes })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_shape() {
        let v = metric_json(&SandboxStatsResponse {
            cpu_count: 2,
            cpu_used_pct: 12.5,
            mem_used_bytes: 10,
            mem_total_bytes: 20,
            mem_cache_bytes: 3,
            disk_used_bytes: 4,
            disk_total_bytes: 5,
            timestamp_ms: 1_700_000_000_123,
        });
        assert_eq!(v["timestamp"], "2023-11-14T22:13:20.123Z");
        assert_eq!(v["timestampUnix"], 1_700_000_000);
        assert_eq!(v["cpuUsedPct"], 12.5);
        for k in [
            "cpuCount",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        ] {
            assert!(v[k].is_u64(), "{k}");
        }
    }

    #[test]
    fn unix_params() {
        let q: HashMap<String, String> = [
            ("start".to_string(), "12".to_string()),
            ("end".to_string(), "x".to_string()),
        ]
        .into_iter()
        .collect();
        assert_eq!(unix_param(&q, "start").unwrap(), Some(12));
        assert!(unix_param(&q, "end").is_err());
        assert_eq!(unix_param(&q, "nope").unwrap(), None);
    }
}
