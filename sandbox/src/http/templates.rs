//! `GET /templates`: the built templates as E2B's `Template` rows, one per template with
//! all its tags. Tags themselves are changed in `tags`, templates built in `builds`.

use std::collections::BTreeMap;

use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::errors::ApiResult;
use super::request::blocking;
use super::{AppState, ENVD_VERSION};
use crate::ids;
use crate::template::tags::template_of;

/// `GET /templates`: the built templates, one row per template in the shape of E2B's
/// `Template`: the build its `default` tag means (else its newest), with every tag in
/// `names` (what this host knows: no teams or spawn counts; every listed build is ready).
pub(super) async fn list_templates(AxState(st): AxState<AppState>) -> ApiResult<Response> {
    let rows = blocking(&st, |h| {
        let store = h.template_store();
        let mut by_name: BTreeMap<String, Vec<crate::template::Template>> = BTreeMap::new();
        for t in h.list_templates()? {
            by_name
                .entry(template_of(&t.name).to_string())
                .or_default()
                .push(t);
        }
        let mut rows = Vec::new();
        for (name, mut builds) in by_name {
            let tags = store.tags(&name)?;
            let shown = tags
                .tags
                .get(crate::template::tags::DEFAULT_TAG)
                .and_then(|d| builds.iter().position(|b| b.name == d.build));
            builds.sort_by_key(|b| b.created_ms);
            let t = match shown {
                Some(i) => builds.swap_remove(i),
                None => builds.pop().expect("a group has a build"),
            };
            let names: Vec<String> = tags.tags.keys().map(|k| format!("{name}:{k}")).collect();
            rows.push((name, t, names, tags.public));
        }
        Ok(rows)
    })
    .await?;
    let out: Vec<Value> = rows
        .iter()
        .map(|(name, t, names, public)| {
            json!({
                "templateID": name,
                "buildID": t.build_id(),
                "aliases": [name],
                "names": names,
                "cpuCount": t.vcpus,
                "memoryMB": t.mem_mib,
                "diskSizeMB": 0,
                "public": public,
                "createdAt": ids::rfc3339(t.created_ms),
                "updatedAt": ids::rfc3339(t.created_ms),
                "envdVersion": ENVD_VERSION,
                "buildStatus": "ready",
            })
        })
        .collect();
    Ok(Json(out).into_response())
}
