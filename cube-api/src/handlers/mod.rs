//! The REST API's handlers, one module per resource, and the router that mounts them.

mod logs;
mod metrics;
mod sandboxes;
mod secrets;
mod snapshots;

use crate::middleware as mw;
use crate::state::AppState;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{delete, get, post, put};
use axum::Router;

/// The control-plane API (E2B's `api.e2b.app` subset the SDKs use).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/sandboxes",
            post(sandboxes::create_v1).get(sandboxes::list),
        )
        .route(
            "/v2/sandboxes",
            post(sandboxes::create_v2).get(sandboxes::list),
        )
        .route(
            "/sandboxes/:id",
            get(sandboxes::get_one).delete(sandboxes::kill),
        )
        .route("/sandboxes/:id/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/:id/refreshes", post(sandboxes::refresh))
        .route("/sandboxes/:id/pause", post(sandboxes::pause))
        .route("/sandboxes/:id/network", put(sandboxes::update_network))
        .route("/sandboxes/:id/resume", post(sandboxes::resume))
        .route("/sandboxes/:id/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/:id/connect", post(sandboxes::connect))
        .route("/sandboxes/:id/snapshots", post(snapshots::create))
        .route("/snapshots", get(snapshots::list))
        .route("/templates/:id", delete(snapshots::delete_template))
        .route("/sandboxes/:id/fork", post(snapshots::fork))
        .route("/v2/sandboxes/:id/fork", post(snapshots::fork))
        .route("/secrets", post(secrets::create).get(secrets::list))
        .route(
            "/secrets/:id",
            get(secrets::get_one)
                .post(secrets::update)
                .delete(secrets::delete),
        )
        .route("/sandboxes/:id/metrics", get(metrics::one))
        .route("/sandboxes/metrics", get(metrics::many))
        .route("/sandboxes/:id/logs", get(logs::v1))
        .route("/v2/sandboxes/:id/logs", get(logs::v2))
        .fallback(mw::not_found)
        .layer(from_fn_with_state(state.clone(), mw::auth))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/openapi.json", get(crate::openapi::serve))
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(from_fn(mw::json_errors))
        .layer(from_fn_with_state(state.clone(), mw::track))
        .with_state(state)
}
