//! E2B's build steps (COPY, RUN, ENV, WORKDIR, USER, as the SDK sends them) evaluated on
//! the base's defaults into a Dockerfile [`Plan`] for [`clade_builder`]: each step's
//! arguments checked, and the environment, directory and user each later step runs with.

use clade_builder::dockerfile::{Action, Plan, Step};
use clade_image::ImageDefaults;

use super::*;

/// The steps of an E2B build evaluated on the base's `defaults`, as a Dockerfile's are.
pub(super) fn plan_of(defaults: &ImageDefaults, req: &StartRequest) -> Result<Plan> {
    let mut env = defaults.env.clone();
    let mut cwd = defaults.cwd.clone();
    let mut user = defaults.user.clone();
    let mut steps = Vec::new();
    let mut forced = req.force;
    for (i, s) in req.steps.iter().enumerate() {
        let n = i + 1;
        let bad = |m: &str| Error::BadRequest(format!("step {n} ({}): {m}", s.kind));
        forced |= s.force;
        let text = format!("{} {}", s.kind, s.args.join(" "));
        let mut push = |action: Action, as_user: &str| {
            steps.push(Step {
                line: n,
                text: text.clone(),
                action,
                env: env.clone(),
                cwd: cwd.clone(),
                user: as_user.to_string(),
                force: forced,
            })
        };
        match s.kind.as_str() {
            "RUN" => {
                let cmd = s.args.first().ok_or_else(|| bad("no command"))?;
                let as_user = s
                    .args
                    .get(1)
                    .filter(|u| !u.is_empty())
                    .cloned()
                    .unwrap_or(user.clone());
                push(
                    Action::Run {
                        argv: vec!["/bin/sh".into(), "-c".into(), cmd.clone()],
                    },
                    &as_user,
                );
            }
            "COPY" => {
                let (src, dest) = match s.args.as_slice() {
                    [src, dest, ..] => (src, dest),
                    _ => return Err(bad("needs a source and a destination")),
                };
                let chown = s.args.get(2).filter(|u| !u.is_empty()).cloned();
                let chmod = match s.args.get(3).filter(|m| !m.is_empty()) {
                    None => None,
                    Some(m) => Some(
                        u32::from_str_radix(m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| bad("its mode is not octal"))?,
                    ),
                };
                if s.files_hash.is_none() {
                    return Err(bad("no filesHash"));
                }
                let src = clade_builder::dockerfile::context_path(n, src)
                    .map_err(|e| bad(&e.to_string()))?;
                let dest = clade_builder::dockerfile::absolute_in(
                    if cwd.is_empty() { "/" } else { &cwd },
                    dest,
                );
                let u = user.clone();
                push(
                    Action::Copy {
                        srcs: vec![src],
                        dest,
                        chown,
                        chmod,
                    },
                    &u,
                );
            }
            "ENV" => {
                if s.args.len() % 2 != 0 {
                    return Err(bad("its arguments are not name/value pairs"));
                }
                for kv in s.args.chunks(2) {
                    if kv[0].is_empty() || kv[0].contains(['=', '\0']) {
                        return Err(bad(&format!("'{}' is not a variable name", kv[0])));
                    }
                    env.retain(|(k, _)| *k != kv[0]);
                    env.push((kv[0].clone(), kv[1].clone()));
                }
            }
            "WORKDIR" => {
                let w = s
                    .args
                    .first()
                    .filter(|w| !w.is_empty())
                    .ok_or_else(|| bad("no directory"))?;
                cwd = clade_builder::dockerfile::absolute_in(
                    if cwd.is_empty() { "/" } else { &cwd },
                    w,
                )
                .trim_end_matches('/')
                .to_string();
                if cwd.is_empty() {
                    cwd = "/".into();
                }
            }
            "USER" => {
                let u = s
                    .args
                    .first()
                    .filter(|u| !u.is_empty())
                    .ok_or_else(|| bad("no user"))?;
                user = u.clone();
            }
            _ => return Err(bad("not supported")),
        }
    }
    Ok(Plan {
        from: String::new(),
        steps,
        defaults: ImageDefaults {
            env,
            cwd,
            user,
            entrypoint: Vec::new(),
            cmd: req.start_cmd.iter().cloned().collect(),
        },
        ignored: Vec::new(),
        unused_args: Vec::new(),
    })
}
