//! The REST query API, as an axum router (testable without a socket).
//!
//! | route | answer |
//! |---|---|
//! | `GET /api/sagas?state=&service=&since=&until=&limit=` | sagas, newest first: live ones from memory, finished ones from the store. `state` is `RUNNING`, `COMPENSATING`, `COMMITTED`, `COMPENSATED` or `FAILED`; `since`/`until` are ms since the epoch (start time); `limit` defaults to 100, at most 10000 |
//! | `GET /api/sagas/{globalTxId}` | one saga: summary, sub-transactions (live ones) and the event timeline still in the store; a compacted saga's kept summary; 404 if unknown |
//! | `GET /api/stats` | live sagas by state, the store's counts, connected instances |
//! | `GET /metrics` | the coordinator's Prometheus metrics |
//!
//! Errors are JSON `{"error": "..."}` with 400 (bad query), 404, or 503
//! (store unavailable; no internal detail beyond the store's message).

use std::sync::{Arc, Mutex};

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::header::CONTENT_TYPE;
use http::StatusCode;
use serde::Serialize;

use crate::event::EventRecord;
use crate::metrics::MetricsRegistry;
use crate::store::{SagaQuery, SagaState, SagaSummary};
use crate::Coordinator;

const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 10_000;

#[derive(Clone)]
struct AppState {
    coordinator: Coordinator,
    registry: MetricsRegistry,
}

/// The REST query API and `/metrics` for `coordinator`.
pub fn router(coordinator: Coordinator) -> axum::Router {
    let registry: MetricsRegistry = Arc::new(Mutex::new(Default::default()));
    coordinator.register_metrics(&registry);
    axum::Router::new()
        .route("/api/sagas", get(list))
        .route("/api/sagas/{id}", get(one))
        .route("/api/stats", get(stats))
        .route("/metrics", get(metrics))
        .with_state(AppState {
            coordinator,
            registry,
        })
}

fn json<T: Serialize>(code: StatusCode, v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(body) => (code, [(CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

fn error(code: StatusCode, msg: impl Into<String>) -> Response {
    json(code, &serde_json::json!({ "error": msg.into() }))
}

fn parse_state(s: &str) -> Option<SagaState> {
    [
        SagaState::Running,
        SagaState::Compensating,
        SagaState::Committed,
        SagaState::Compensated,
        SagaState::Failed,
    ]
    .into_iter()
    .find(|st| st.as_str().eq_ignore_ascii_case(s))
}

/// Parses the list query; a message for 400 otherwise.
fn parse_query(raw: Option<&str>) -> Result<SagaQuery, String> {
    let mut q = SagaQuery {
        limit: DEFAULT_LIMIT,
        ..SagaQuery::default()
    };
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_encoding::percent_decode_str(&v.replace('+', " "))
            .decode_utf8()
            .map_err(|_| format!("query parameter {k} is not UTF-8"))?
            .into_owned();
        match k {
            "state" => {
                q.state = Some(parse_state(&v).ok_or_else(|| {
                    format!("unknown state {v:?}; use RUNNING, COMPENSATING, COMMITTED, COMPENSATED or FAILED")
                })?);
            }
            "service" => q.service_name = Some(v),
            "since" => {
                q.since_ms = Some(
                    v.parse()
                        .map_err(|_| "since must be milliseconds since the epoch".to_owned())?,
                );
            }
            "until" => {
                q.until_ms = Some(
                    v.parse()
                        .map_err(|_| "until must be milliseconds since the epoch".to_owned())?,
                );
            }
            "limit" => {
                let n: usize = v
                    .parse()
                    .map_err(|_| "limit must be a positive number".to_owned())?;
                q.limit = n.clamp(1, MAX_LIMIT);
            }
            other => return Err(format!("unknown query parameter {other:?}")),
        }
    }
    Ok(q)
}

fn matches(q: &SagaQuery, s: &SagaSummary) -> bool {
    q.state.is_none_or(|st| s.state == st)
        && q.service_name
            .as_deref()
            .is_none_or(|n| s.service_name == n)
        && q.since_ms.is_none_or(|t| s.started_ms >= t)
        && q.until_ms.is_none_or(|t| s.started_ms < t)
}

/// Runs `f` (a walk over every live saga) on the blocking pool, not an
/// async worker; a panic in it is a 500 naming `what`.
async fn off_workers<T: Send + 'static>(
    app: &AppState,
    what: &str,
    f: impl FnOnce(&crate::engine::Engine) -> T + Send + 'static,
) -> Result<T, Response> {
    let engine = app.coordinator.engine.clone();
    tokio::task::spawn_blocking(move || f(&engine))
        .await
        .map_err(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{what} failed: {e}"),
            )
        })
}

async fn list(State(app): State<AppState>, RawQuery(raw): RawQuery) -> Response {
    let q = match parse_query(raw.as_deref()) {
        Ok(q) => q,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    let want_live = q.state.is_none_or(|s| !s.is_terminal());
    let want_finished = q.state.is_none_or(SagaState::is_terminal);
    let mut out = if want_live {
        let lq = q.clone();
        match off_workers(&app, "listing live sagas", move |e| {
            e.live_summaries(&|s| matches(&lq, s), lq.limit)
        })
        .await
        {
            Ok(live) => live,
            Err(answer) => return answer,
        }
    } else {
        Vec::new()
    };
    if want_finished {
        match app.coordinator.store().finished(q.clone()).await {
            Ok(f) => out.extend(f),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }
    out.sort_by_key(|s| std::cmp::Reverse(s.started_ms));
    out.truncate(q.limit);
    json(StatusCode::OK, &serde_json::json!({ "sagas": out }))
}

/// One event of a timeline, as JSON.
#[derive(Serialize)]
struct TimelineEvent {
    #[serde(rename = "type")]
    kind: &'static str,
    local_tx_id: String,
    parent_tx_id: String,
    service_name: String,
    instance_id: String,
    timestamp_ms: i64,
    payload_bytes: usize,
}

impl From<EventRecord> for TimelineEvent {
    fn from(e: EventRecord) -> Self {
        Self {
            kind: e.kind.map_or("", |k| k.as_str()),
            local_tx_id: e.local_tx_id,
            parent_tx_id: e.parent_tx_id,
            service_name: e.service_name.to_string(),
            instance_id: e.instance_id.to_string(),
            timestamp_ms: e.timestamp_ms,
            payload_bytes: e.payloads.len(),
        }
    }
}

async fn one(State(app): State<AppState>, Path(id): Path<String>) -> Response {
    let live = app.coordinator.saga(&id);
    let timeline = match app.coordinator.store().timeline(id.clone()).await {
        Ok(t) => t,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let timeline: Vec<TimelineEvent> = timeline.into_iter().map(Into::into).collect();
    if let Some(v) = live {
        return json(
            StatusCode::OK,
            &serde_json::json!({ "saga": v, "timeline": timeline }),
        );
    }
    if let Some(s) = app.coordinator.engine.finished_summary(&id) {
        return json(
            StatusCode::OK,
            &serde_json::json!({ "saga": s, "timeline": timeline }),
        );
    }
    if !timeline.is_empty() {
        return json(
            StatusCode::OK,
            &serde_json::json!({ "saga": null, "timeline": timeline }),
        );
    }
    // Finished and compacted (and no longer in the recent cache, e.g. after
    // a restart): its summary is all the store keeps.
    let kept = app
        .coordinator
        .store()
        .finished(SagaQuery {
            global_tx_id: Some(id.clone()),
            limit: 1,
            ..SagaQuery::default()
        })
        .await;
    match kept {
        Ok(mut found) if !found.is_empty() => json(
            StatusCode::OK,
            &serde_json::json!({ "saga": found.swap_remove(0), "timeline": timeline }),
        ),
        Ok(_) => error(
            StatusCode::NOT_FOUND,
            format!("no saga {id:?} in memory or in the store (finished sagas are kept within the store's retention)"),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn stats(State(app): State<AppState>) -> Response {
    let (running, compensating) =
        match off_workers(&app, "counting live sagas", |e| e.live_counts()).await {
            Ok(counts) => counts,
            Err(answer) => return answer,
        };
    let store = match app.coordinator.store().stats().await {
        Ok(s) => s,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    json(
        StatusCode::OK,
        &serde_json::json!({
            "live": { "RUNNING": running, "COMPENSATING": compensating },
            "store": {
                "name": app.coordinator.store().name(),
                "events": store.events,
                "finished": store.finished.into_iter().collect::<std::collections::BTreeMap<_, _>>(),
                "commits": store.commits,
                "disk_bytes": store.disk_bytes,
            },
            "instances": app.coordinator.instances(),
        }),
    )
}

async fn metrics(State(app): State<AppState>) -> Response {
    (
        StatusCode::OK,
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        crate::metrics::encode(&app.registry),
    )
        .into_response()
}
