//! Sandboxes: create, list, get, kill, timeouts, pause and resume, network.

use crate::body::{unsupported, Fields};
use crate::error::ApiError;
use crate::extract::{no_sandbox, Body, OptionalBody, Params, SandboxId, Team};
use crate::rfc3339;
use crate::state::AppState;
use crate::ApiConfig;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cube_proto::master::v1 as pb;
use serde_json::{json, Value};
use std::collections::BTreeMap;

fn domain(cfg: &ApiConfig) -> Value {
    if cfg.domain.is_empty() {
        Value::Null
    } else {
        Value::String(cfg.domain.clone())
    }
}

/// The `Sandbox` object of create/connect responses.
pub(super) fn sandbox_json(s: &pb::SandboxInfo, cfg: &ApiConfig) -> Value {
    json!({
        "templateID": s.template,
        "sandboxID": s.sandbox_id,
        "clientID": "cube",
        "envdVersion": s.envd_version,
        "alias": s.template,
        "envdAccessToken": s.access_token,
        // The code interpreter SDK sends it on every call to 49999 (the edge requires it or
        // the envd token there).
        "trafficAccessToken": crate::edge::traffic_token(&s.access_token),
        "domain": domain(cfg),
    })
}

/// E2B shows `creating`/`resuming` as running and `pausing` as paused.
fn public_state(s: &str) -> &'static str {
    match s {
        "paused" | "pausing" => "paused",
        _ => "running",
    }
}

fn listed_json(s: &pb::SandboxInfo) -> Value {
    json!({
        "templateID": s.template,
        "alias": s.template,
        "sandboxID": s.sandbox_id,
        "clientID": "cube",
        "startedAt": rfc3339::format(s.started_at_ms),
        "endAt": rfc3339::format(s.end_at_ms),
        "cpuCount": s.vcpus,
        "memoryMB": s.memory_mib,
        "diskSizeMB": s.disk_mib,
        "state": public_state(&s.state),
        "envdVersion": s.envd_version,
        "metadata": s.metadata,
    })
}

fn detail_json(s: &pb::SandboxInfo, cfg: &ApiConfig) -> Value {
    let mut v = listed_json(s);
    if let Value::Object(o) = &mut v {
        o.insert("envdAccessToken".into(), json!(s.access_token));
        o.insert("domain".into(), domain(cfg));
        o.insert("allowInternetAccess".into(), json!(s.allow_internet));
        // Not E2B's: which runtime runs it ("microvm", "namespace") and what boundary that is.
        o.insert("runtime".into(), json!(s.runtime));
        o.insert(
            "isolation".into(),
            json!(cube_proto::isolation::of(&s.runtime)),
        );
        o.insert(
            "lifecycle".into(),
            json!({
                "autoResume": s.auto_resume,
                "onTimeout": if s.auto_pause { "pause" } else { "kill" },
            }),
        );
        let mut network = serde_json::Map::new();
        network.insert("allowPublicTraffic".into(), json!(!s.private_ports));
        if !s.allow_out.is_empty() {
            network.insert("allowOut".into(), json!(s.allow_out));
        }
        if !s.deny_out.is_empty() {
            network.insert("denyOut".into(), json!(s.deny_out));
        }
        if let Some(d) = &s.dns_servers {
            network.insert("dnsServers".into(), json!(d.servers));
        }
        if !s.mask_request_host.is_empty() {
            network.insert("maskRequestHost".into(), json!(s.mask_request_host));
        }
        o.insert("network".into(), Value::Object(network));
        // What its pause kept: "full", or "filesystem" (it restarts on resume).
        if public_state(&s.state) == "paused" && !s.pause_mode.is_empty() {
            o.insert("pauseMode".into(), json!(s.pause_mode));
        }
    }
    v
}

/// Reads E2B's `NewSandbox` / `NewSandboxV2` body into a create request. Every field is
/// either implemented or refused by name (nothing the SDK asks for is silently ignored).
fn create_request(
    mut b: Fields,
    team: Team,
    default_timeout: u64,
) -> Result<pb::CreateSandboxRequest, ApiError> {
    let template = match b.string("templateID")? {
        // Template names and ids are short; a huge one would only fail deep in gRPC.
        Some(s) if s.len() > 256 => return Err(ApiError::bad_request("templateID is too long")),
        Some(s) if !s.is_empty() => s,
        _ => return Err(ApiError::bad_request("templateID is required")),
    };
    let timeout_s = b.timeout(Some(default_timeout))?;
    let metadata = b.string_map("metadata")?;
    let env_vars = b.string_map("envVars")?;
    let allow_internet = b.bool("allow_internet_access")?;
    // Old SDKs send `secure: true`; every Cube sandbox needs its envd access token.
    if b.bool("secure")? == Some(false) {
        return Err(unsupported(
            "secure: false",
            "every sandbox's envd requires its access token",
        ));
    }
    let auto_pause = b.bool("autoPause")?.unwrap_or(false);
    // Read with or without autoPause (E2B's field: the SDK's model may send it with autoPause
    // false), but it only matters with autoPause, as in E2B (the master refuses it with
    // autoResume).
    let auto_pause_memory = b.bool("autoPauseMemory")?;
    let auto_pause_filesystem = auto_pause && auto_pause_memory == Some(false);
    let auto_resume = match b.object("autoResume")? {
        None => false,
        Some(mut r) => {
            let on = r.bool("enabled")?.unwrap_or(false);
            r.finish()?;
            on
        }
    };
    let (mut private_ports, mut mask_request_host) = (false, String::new());
    let mut egress = Egress::default();
    if let Some(mut n) = b.object("network")? {
        private_ports = n.bool("allowPublicTraffic")? == Some(false);
        if let Some(m) = n.string("maskRequestHost")? {
            // A header value, short, with at most the one placeholder E2B defines.
            let plain = m.replace("${PORT}", "1");
            if m.len() > 255
                || !plain
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]_".contains(&b))
            {
                return Err(ApiError::bad_request(
                    "network.maskRequestHost must be a host[:port] (letters, digits, '-', '.', ':', '_', \"${PORT}\"), at most 255 characters",
                ));
            }
            mask_request_host = m;
        }
        egress = Egress::take(&mut n, "network.")?;
        n.unsupported("httpsPorts", "the edge speaks plain HTTP to sandbox ports")?;
        n.finish()?;
    }
    b.unsupported("mcp", "no MCP gateway runs in Cube sandboxes")?;
    b.unsupported("iam", "no workload identity tokens are issued")?;
    b.unsupported("volumeMounts", "volumes are not implemented")?;
    b.finish()?;
    Ok(pb::CreateSandboxRequest {
        team_id: team.0,
        template,
        timeout_s,
        metadata,
        env_vars,
        allow_internet,
        auto_pause,
        auto_resume,
        auto_pause_filesystem,
        idempotency_key: String::new(),
        private_ports,
        mask_request_host,
        allow_out: egress.allow_out,
        deny_out: egress.deny_out,
        dns_servers: egress.dns_servers,
    })
}

/// The egress part of E2B's network config, as create and update network read it; the master
/// checks the entries (egress.rs there).
#[derive(Default)]
struct Egress {
    allow_out: Vec<String>,
    deny_out: Vec<String>,
    /// Absent or `null` = not given (the node's resolver serves allowOut's domain names).
    dns_servers: Option<pb::DnsServers>,
}

impl Egress {
    /// `at`: where these fields sit, for messages (`"network."` at create, `""` in the update
    /// network body).
    fn take(n: &mut Fields, at: &str) -> Result<Egress, ApiError> {
        let bad = || ApiError::bad_request(format!("{at}dnsServers must be a list of strings"));
        let dns_servers = match n.take("dnsServers") {
            None => None,
            Some(Value::Array(a)) => Some(pb::DnsServers {
                servers: a
                    .into_iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s),
                        _ => Err(bad()),
                    })
                    .collect::<Result<_, _>>()?,
            }),
            Some(_) => return Err(bad()),
        };
        let e = Egress {
            allow_out: n.string_list("allowOut")?,
            deny_out: n.string_list("denyOut")?,
            dns_servers,
        };
        n.unsupported("egressProxy", "no egress proxy is implemented")?;
        n.unsupported("rules", "per-domain transform rules are not implemented")?;
        Ok(e)
    }
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's whole egress configuration; what the
/// body omits is cleared (`allow_internet_access` then defaults to true, as at create): 204.
pub(super) async fn update_network(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(mut b): OptionalBody,
) -> Result<Response, ApiError> {
    let egress = Egress::take(&mut b, "")?;
    let allow_internet = b.bool("allow_internet_access")?.unwrap_or(true);
    b.finish()?;
    let mut m = st.master.clone();
    m.update_network(pb::UpdateNetworkRequest {
        team_id: team.0,
        sandbox_id: id,
        allow_internet,
        allow_out: egress.allow_out,
        deny_out: egress.deny_out,
        dns_servers: egress.dns_servers,
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn create(
    st: AppState,
    team: Team,
    headers: HeaderMap,
    body: Fields,
    default_timeout: u64,
) -> Result<Response, ApiError> {
    let mut req = create_request(body, team, default_timeout)?;
    // The master checks the key's form; here only that the header is there and text.
    if let Some(k) = headers.get("idempotency-key") {
        req.idempotency_key = k
            .to_str()
            .ok()
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                ApiError::bad_request("Idempotency-Key must be 1-255 printable ASCII characters")
            })?
            .to_string();
    } else {
        req.idempotency_key = st.retry_keys.next();
    }
    let mut master = st.master.clone();
    let r = master.create_sandbox(req).await?.into_inner();
    Ok((StatusCode::CREATED, Json(sandbox_json(&r, &st.cfg))).into_response())
}

pub(super) async fn create_v1(
    State(st): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let d = st.cfg.default_timeout_v1_s;
    create(st, team, headers, body, d).await
}

pub(super) async fn create_v2(
    State(st): State<AppState>,
    team: Team,
    headers: HeaderMap,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let d = st.cfg.default_timeout_v2_s;
    create(st, team, headers, body, d).await
}

fn sref(team: &Team, id: &str) -> pb::SandboxRef {
    pb::SandboxRef {
        team_id: team.0.clone(),
        sandbox_id: id.to_string(),
    }
}

pub(super) async fn get_one(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
) -> Result<Response, ApiError> {
    let mut m = st.master.clone();
    let r = m.get_sandbox(sref(&team, &id)).await?.into_inner();
    Ok(Json(detail_json(&r, &st.cfg)).into_response())
}

pub(super) async fn kill(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
) -> Result<Response, ApiError> {
    let mut m = st.master.clone();
    let r = m.kill_sandbox(sref(&team, &id)).await;
    // Whatever the outcome, the edge must ask the master again.
    st.invalidate(&id);
    if !r?.into_inner().existed {
        return Err(no_sandbox(&id));
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn set_timeout(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    Body(mut b): Body,
) -> Result<Response, ApiError> {
    let t = b.timeout(None)?;
    b.finish()?;
    change_end(&st, team, id, t, false).await
}

/// Sets a sandbox's end to now + `t` (with `extend_only`, only if that is later): 204.
async fn change_end(
    st: &AppState,
    team: Team,
    id: String,
    t: u64,
    extend_only: bool,
) -> Result<Response, ApiError> {
    let mut m = st.master.clone();
    m.set_timeout(pb::SetTimeoutRequest {
        team_id: team.0,
        sandbox_id: id.clone(),
        timeout_s: t,
        extend_only,
    })
    .await?;
    // The edge treats a sandbox past its end as possibly paused: it must see the new end.
    st.invalidate(&id);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Longest refresh E2B allows, in seconds.
const MAX_REFRESH_S: i64 = 3600;

/// `POST /sandboxes/{id}/refreshes {"duration"?: 0..3600}`: keeps the sandbox alive for at
/// least `duration` more seconds (never shortens it; absent = the v1 default timeout).
pub(super) async fn refresh(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(mut b): OptionalBody,
) -> Result<Response, ApiError> {
    let d = match b.int("duration")? {
        None => st.cfg.default_timeout_v1_s,
        Some(d) if (0..=MAX_REFRESH_S).contains(&d) => d as u64,
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "duration must be between 0 and {MAX_REFRESH_S} seconds"
            )))
        }
    };
    b.finish()?;
    change_end(&st, team, id, d, true).await
}

/// `memory: false`: a filesystem-only pause, or a resume that starts the sandbox afresh.
fn without_memory(b: &mut Fields) -> Result<bool, ApiError> {
    Ok(b.bool("memory")? == Some(false))
}

pub(super) async fn pause(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(mut b): OptionalBody,
) -> Result<Response, ApiError> {
    // Old SDKs send no body, new ones `{}` or `{"memory": ...}`.
    let filesystem_only = without_memory(&mut b)?;
    // SDK `pause(strict=True)`: refused with 503, the sandbox running, while its agent does
    // not answer.
    let require_healthy_guest = b.bool("requireHealthyGuest")?.unwrap_or(false);
    b.finish()?;
    let mut m = st.master.clone();
    let r = m
        .pause_sandbox(pb::PauseSandboxRequest {
            team_id: team.0.clone(),
            sandbox_id: id.clone(),
            require_healthy_guest,
            filesystem_only,
        })
        .await;
    st.invalidate(&id);
    r?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn connect_inner(
    st: &AppState,
    team: Team,
    id: String,
    mut b: Fields,
) -> Result<(pb::ConnectSandboxResponse, u64), ApiError> {
    let t = b.timeout(Some(st.cfg.default_timeout_v2_s))?;
    let reboot = without_memory(&mut b)?;
    // The legacy resume's `autoPause` (SDK 2.0-2.5) only ever sends false.
    if b.bool("autoPause")? == Some(true) {
        return Err(unsupported(
            "autoPause on resume",
            "set autoPause when the sandbox is created",
        ));
    }
    b.finish()?;
    let mut m = st.master.clone();
    // A resume may move the sandbox to a new address: drop what the edge knew.
    st.invalidate(&id);
    let r = m
        .connect_sandbox(pb::ConnectSandboxRequest {
            team_id: team.0,
            sandbox_id: id,
            timeout_s: t,
            reboot,
        })
        .await?
        .into_inner();
    Ok((r, t))
}

pub(super) async fn connect(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(b): OptionalBody,
) -> Result<Response, ApiError> {
    let (r, _) = connect_inner(&st, team, id, b).await?;
    let sb = r
        .sandbox
        .ok_or_else(|| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "empty connect reply"))?;
    let code = if r.resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(sandbox_json(&sb, &st.cfg))).into_response())
}

/// Legacy resume (SDK 2.0–2.5): 409 when the sandbox is already running.
pub(super) async fn resume(
    State(st): State<AppState>,
    team: Team,
    SandboxId(id): SandboxId,
    OptionalBody(b): OptionalBody,
) -> Result<Response, ApiError> {
    let mut m = st.master.clone();
    let cur = m.get_sandbox(sref(&team, &id)).await?.into_inner();
    if cur.state == "running" {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("Sandbox \"{id}\" is already running"),
        ));
    }
    let (r, _) = connect_inner(&st, team, id, b).await?;
    let sb = r
        .sandbox
        .ok_or_else(|| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "empty resume reply"))?;
    Ok((StatusCode::CREATED, Json(sandbox_json(&sb, &st.cfg))).into_response())
}

pub(super) async fn list(
    State(st): State<AppState>,
    team: Team,
    Params(q): Params,
) -> Result<Response, ApiError> {
    const KNOWN: [&str; 7] = [
        "state",
        "metadata",
        "limit",
        "order",
        "nextToken",
        "template",
        "startedAfter",
    ];
    let mut unknown: Vec<&str> = q
        .keys()
        .map(String::as_str)
        .filter(|k| !KNOWN.contains(k))
        .collect();
    if !unknown.is_empty() {
        unknown.sort_unstable();
        return Err(ApiError::bad_request(format!(
            "unknown query parameter(s) {}: Cube does not implement them",
            unknown.join(", ")
        )));
    }
    let started_after_ms = match q.get("startedAfter") {
        None => 0,
        Some(t) => rfc3339::parse_ms(t).ok_or_else(|| {
            ApiError::bad_request(format!(
                "startedAfter must be an RFC 3339 time (got {:?})",
                t.chars().take(64).collect::<String>()
            ))
        })?,
    };
    let mut states = Vec::new();
    if let Some(s) = q.get("state") {
        for x in s.split(',').filter(|x| !x.is_empty()) {
            match x {
                "running" => states.extend(["running", "creating", "resuming"]),
                "paused" => states.extend(["paused", "pausing"]),
                other => return Err(ApiError::bad_request(format!("invalid state {other:?}"))),
            }
        }
    }
    let mut metadata = BTreeMap::new();
    if let Some(md) = q.get("metadata") {
        for (k, v) in url::form_urlencoded::parse(md.as_bytes()) {
            metadata.insert(k.into_owned(), v.into_owned());
        }
    }
    let limit = crate::paging::limit(&q)?;
    let ascending = match q.get("order").map(String::as_str) {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(o) => return Err(ApiError::bad_request(format!("invalid order {o:?}"))),
    };
    let mut m = st.master.clone();
    let r = m
        .list_sandboxes(pb::ListSandboxesRequest {
            team_id: team.0,
            states: states.into_iter().map(String::from).collect(),
            metadata: metadata.into_iter().collect(),
            limit,
            next_token: crate::paging::next_token(&q),
            ascending,
            template: q.get("template").cloned().unwrap_or_default(),
            started_after_ms,
        })
        .await?
        .into_inner();
    let items: Vec<Value> = r.sandboxes.iter().map(listed_json).collect();
    let headers = crate::paging::next_page_headers(&r.next_token);
    Ok((StatusCode::OK, headers, Json(Value::Array(items))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: &str) -> Result<pb::CreateSandboxRequest, ApiError> {
        let b = Fields::parse(&axum::body::Bytes::from(body.to_string()), false)?;
        create_request(b, Team("t".into()), 300)
    }

    #[test]
    fn every_sdks_create_body_is_read() {
        // Bodies captured from the SDKs (py 2.20, 2.45, 2.63; js 2.13, 2.51).
        for body in [
            r#"{"templateID":"base","allow_internet_access":true,"autoPause":false,"envVars":{},"metadata":{},"secure":true,"timeout":120}"#,
            r#"{"templateID":"base","timeout":120,"secure":true,"allow_internet_access":true,"metadata":{},"envVars":{}}"#,
            r#"{"templateID":"base","metadata":{"k":"v"},"envVars":{"A":"1"},"timeout":120}"#,
            r#"{"templateID":"code-interpreter-v1"}"#,
        ] {
            let r = req(body).unwrap_or_else(|e| panic!("{body}: {e}"));
            assert!(!r.auto_pause && !r.auto_resume);
        }
        let r = req(r#"{"templateID":"base","autoPause":true,"autoPauseMemory":true,"autoResume":{"enabled":true},"allow_internet_access":false,"network":{"allowPublicTraffic":true,"allowOut":[]},"mcp":null}"#).unwrap();
        assert!(r.auto_pause && r.auto_resume && !r.private_ports);
        assert_eq!(r.allow_internet, Some(false));
        // autoPauseMemory is E2B's and read with or without autoPause; it only matters with it.
        for (body, filesystem) in [
            (
                r#"{"templateID":"base","autoPause":false,"autoPauseMemory":true}"#,
                false,
            ),
            (r#"{"templateID":"base","autoPauseMemory":false}"#, false),
            (
                r#"{"templateID":"base","autoPause":null,"autoPauseMemory":null}"#,
                false,
            ),
            (
                r#"{"templateID":"base","autoPause":true,"autoPauseMemory":true}"#,
                false,
            ),
            (
                r#"{"templateID":"base","autoPause":true,"autoPauseMemory":false}"#,
                true,
            ),
        ] {
            let r = req(body).unwrap_or_else(|e| panic!("{body}: {e}"));
            assert_eq!(r.auto_pause_filesystem, filesystem, "{body}");
        }
        let p = req(r#"{"templateID":"base","network":{"allowPublicTraffic":false,"maskRequestHost":"localhost:${PORT}"}}"#).unwrap();
        assert!(p.private_ports);
        assert_eq!(p.mask_request_host, "localhost:${PORT}");
        assert_eq!(r.timeout_s, 300);
        // Egress lists go to the master as given (it checks the entries).
        let e = req(r#"{"templateID":"base","network":{"allowOut":["1.1.1.1","example.com"],"denyOut":["0.0.0.0/0"],"dnsServers":[]}}"#).unwrap();
        assert_eq!(
            (e.allow_out, e.deny_out),
            (
                vec!["1.1.1.1".to_string(), "example.com".to_string()],
                vec!["0.0.0.0/0".to_string()]
            )
        );
        // dnsServers: an empty list is one (no DNS), absent or null is none given.
        assert_eq!(e.dns_servers, Some(pb::DnsServers { servers: vec![] }));
        let d = req(r#"{"templateID":"base","network":{"allowOut":["*.example.com"],"dnsServers":["1.1.1.1","8.8.8.8"]}}"#).unwrap();
        assert_eq!(
            d.dns_servers.map(|d| d.servers),
            Some(vec!["1.1.1.1".to_string(), "8.8.8.8".to_string()])
        );
        for body in [
            r#"{"templateID":"base","network":{"dnsServers":null}}"#,
            r#"{"templateID":"base","network":{}}"#,
        ] {
            assert_eq!(req(body).unwrap().dns_servers, None, "{body}");
        }
    }

    #[test]
    fn detail_reports_the_network() {
        let mut s = pb::SandboxInfo {
            allow_out: vec!["example.com".into()],
            ..Default::default()
        };
        let cfg = ApiConfig::default();
        let n = |s: &pb::SandboxInfo| detail_json(s, &cfg)["network"].clone();
        assert_eq!(n(&s)["allowOut"], json!(["example.com"]));
        assert!(n(&s).get("dnsServers").is_none());
        s.dns_servers = Some(pb::DnsServers { servers: vec![] });
        assert_eq!(n(&s)["dnsServers"], json!([]));
        s.dns_servers = Some(pb::DnsServers {
            servers: vec!["1.1.1.1".into()],
        });
        assert_eq!(n(&s)["dnsServers"], json!(["1.1.1.1"]));
    }

    #[test]
    fn what_cube_does_not_implement_is_refused_by_name() {
        for (body, named) in [
            (
                r#"{"templateID":"base","network":{"denyOut":"10.0.0.1/32"}}"#,
                "network.denyOut must be a list of strings",
            ),
            (
                r#"{"templateID":"base","network":{"allowOut":[1]}}"#,
                "network.allowOut must be a list of strings",
            ),
            (
                r#"{"templateID":"base","network":{"dnsServers":"1.1.1.1"}}"#,
                "network.dnsServers must be a list of strings",
            ),
            (
                r#"{"templateID":"base","network":{"dnsServers":[1]}}"#,
                "network.dnsServers must be a list of strings",
            ),
            (
                r#"{"templateID":"base","network":{"egressProxy":{"address":"p:1080"}}}"#,
                "network.egressProxy",
            ),
            (
                r#"{"templateID":"base","network":{"rules":{"a.com":[]}}}"#,
                "network.rules",
            ),
            (
                r#"{"templateID":"base","network":{"maskRequestHost":"a\r\nb"}}"#,
                "network.maskRequestHost",
            ),
            (
                r#"{"templateID":"base","network":{"httpsPorts":[443]}}"#,
                "network.httpsPorts",
            ),
            (
                r#"{"templateID":"base","network":{"bogus":1}}"#,
                "network.bogus",
            ),
            (r#"{"templateID":"base","mcp":{"github":{}}}"#, "mcp"),
            (r#"{"templateID":"base","iam":{"tokens":{}}}"#, "iam"),
            (
                r#"{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]}"#,
                "volumeMounts",
            ),
            (r#"{"templateID":"base","secure":false}"#, "secure"),
            (
                r#"{"templateID":"base","autoResume":{"enabled":true,"x":1}}"#,
                "autoResume.x",
            ),
            (r#"{"templateID":"base","frobnicate":true}"#, "frobnicate"),
        ] {
            let e = req(body).expect_err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert!(e.message.contains(named), "{body}: {}", e.message);
        }
    }
}
