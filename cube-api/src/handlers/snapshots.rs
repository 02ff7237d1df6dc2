//! Snapshots and fork (E2B §2.3): `POST /sandboxes/{id}/snapshots`, `GET /snapshots`,
//! `DELETE /templates/{id}` (how the SDK deletes a snapshot) and `POST /sandboxes/{id}/fork`.

use super::sandboxes::sandbox_json;
use crate::error::ApiError;
use crate::extract::{OptionalBody, Param, Params, SandboxId, Team};
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cube_proto::master::v1 as pb;
use serde_json::{json, Value};

/// Most sandboxes one fork may create (E2B's limit).
const MAX_FORK: u64 = 20;

fn snapshot_json(s: &pb::SnapshotInfo) -> Value {
    json!({"snapshotID": s.snapshot_id, "names": s.names})
}

/// `POST /sandboxes/{id}/snapshots` `{"name"?: str, "memory"?: bool}` → 201 `SnapshotInfo`.
pub(super) async fn create(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(mut b): OptionalBody,
) -> Result<Response, ApiError> {
    let name = b.string("name")?.unwrap_or_default();
    // `memory` is accepted either way: what was captured is the node's runtime's to say
    // (filesystem only on the namespace runtime).
    b.bool("memory")?;
    b.finish()?;
    let mut m = st.master.clone();
    let s = m
        .snapshot_sandbox(pb::SnapshotSandboxRequest {
            team_id: team.0,
            sandbox_id: id,
            name,
        })
        .await?
        .into_inner();
    Ok((StatusCode::CREATED, Json(snapshot_json(&s))).into_response())
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=` → 200 `[SnapshotInfo]` + `X-Next-Token`.
pub(super) async fn list(
    State(st): State<AppState>,
    team: Team,
    Params(q): Params,
) -> Result<Response, ApiError> {
    let limit = crate::paging::limit(&q)?;
    let mut m = st.master.clone();
    let r = m
        .list_snapshots(pb::ListSnapshotsRequest {
            team_id: team.0,
            sandbox_id: q.get("sandboxID").cloned().unwrap_or_default(),
            name: q.get("name").cloned().unwrap_or_default(),
            limit,
            next_token: crate::paging::next_token(&q),
        })
        .await?
        .into_inner();
    let headers = crate::paging::next_page_headers(&r.next_token);
    let items: Vec<Value> = r.snapshots.iter().map(snapshot_json).collect();
    Ok((StatusCode::OK, headers, Json(Value::Array(items))).into_response())
}

/// `DELETE /templates/{id}`: deletes one of the team's snapshots (204). Templates proper are
/// the operator's (`cubectl template rm`): 403 for those, 404 for anything else.
pub(super) async fn delete_template(
    State(st): State<AppState>,
    team: Team,
    Param(id): Param,
) -> Result<Response, ApiError> {
    let plausible = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    let not_found = || {
        let shown: String = id.chars().take(64).collect();
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!("Template \"{shown}\" doesn't exist or you don't have access to it"),
        )
    };
    if !plausible {
        return Err(not_found());
    }
    let mut m = st.master.clone();
    let r = m
        .delete_snapshot(pb::DeleteSnapshotRequest {
            team_id: team.0,
            snapshot_id: id.clone(),
        })
        .await?
        .into_inner();
    if r.existed {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    match m.get_template(pb::TemplateRef { name: id.clone() }).await {
        Ok(_) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("Template \"{id}\" is managed by the operator (cubectl template rm)"),
        )),
        Err(_) => Err(not_found()),
    }
}

/// HTTP status for a fork result's gRPC code name.
fn fork_error_status(code: &str) -> StatusCode {
    match code {
        "INVALID_ARGUMENT" | "OUT_OF_RANGE" => StatusCode::BAD_REQUEST,
        "NOT_FOUND" => StatusCode::NOT_FOUND,
        "FAILED_PRECONDITION" | "ALREADY_EXISTS" | "ABORTED" => StatusCode::CONFLICT,
        "RESOURCE_EXHAUSTED" => StatusCode::TOO_MANY_REQUESTS,
        "UNAVAILABLE" => StatusCode::SERVICE_UNAVAILABLE,
        "DEADLINE_EXCEEDED" => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// `POST /sandboxes/{id}/fork` `{"timeout"?: int, "count"?: 1..20}` → 201
/// `[{"sandbox": Sandbox} | {"error": {code, message}}]`, one entry per requested fork.
pub(super) async fn fork(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(mut b): OptionalBody,
) -> Result<Response, ApiError> {
    let timeout_s = b.timeout(Some(st.cfg.default_timeout_v2_s))?;
    let bad_count =
        || ApiError::bad_request(format!("count must be an integer between 1 and {MAX_FORK}"));
    let count = match b.int("count").map_err(|_| bad_count())? {
        None => 1,
        Some(c) if (1..=MAX_FORK as i64).contains(&c) => c as u32,
        Some(_) => return Err(bad_count()),
    };
    b.finish()?;
    let mut m = st.master.clone();
    let r = m
        .fork_sandbox(pb::ForkSandboxRequest {
            team_id: team.0,
            sandbox_id: id,
            count,
            timeout_s,
        })
        .await?
        .into_inner();
    let items: Vec<Value> = r
        .results
        .iter()
        .map(|x| match &x.sandbox {
            Some(s) => json!({"sandbox": sandbox_json(s, &st.cfg)}),
            None => {
                let code = fork_error_status(&x.error_code);
                json!({"error": {"code": code.as_u16(), "message": x.error}})
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(Value::Array(items))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_error_codes() {
        assert_eq!(
            fork_error_status("RESOURCE_EXHAUSTED"),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(fork_error_status("NOT_FOUND"), StatusCode::NOT_FOUND);
        assert_eq!(
            fork_error_status("whatever"),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn snapshot_shape() {
        let v = snapshot_json(&pb::SnapshotInfo {
            snapshot_id: "sabc".into(),
            names: vec!["sabc".into(), "mine".into()],
            ..Default::default()
        });
        assert_eq!(v, json!({"snapshotID": "sabc", "names": ["sabc", "mine"]}));
    }
}
