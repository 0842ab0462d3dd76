//! The base disk layer of a template built from a container image (`--image`) or a
//! Dockerfile (`--dockerfile`): the image pulled if it is a registry reference, its root
//! filesystem converted once into the build cache, a Dockerfile's steps run in build VMs
//! (each step's layer cached), and the image's defaults (environment, working directory,
//! user, start command) for the template.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clade_builder::vm::VmSpec;
use sandbox::template::FromImage;
use sandbox::TemplateStore;

use super::BuildArgs;

/// The image `name` names, as a layout or archive path: pulled into the state dir's
/// `images/` cache when it is a registry reference.
fn image_layout(name: &str, state_dir: &Path) -> anyhow::Result<PathBuf> {
    if !clade_image::is_reference(name) || Path::new(name).exists() {
        return Ok(PathBuf::from(name));
    }
    let cache = state_dir.join("images");
    let progress = Arc::new(clade_image::PullProgress::default());
    let bar = crate::cli::progress::Bar::bytes("pull", 0);
    let shown = {
        let p = progress.clone();
        bar.follow(move || p.get())
    };
    let pulled = clade_image::pull(name, &cache, Some(&progress));
    shown.finish(pulled.is_ok());
    let r = pulled?;
    eprintln!(
        "pulled {name} ({}): {} blobs fetched ({} KiB), {} already cached",
        r.manifest_digest,
        r.fetched,
        r.bytes >> 10,
        r.cached
    );
    Ok(r.layout)
}

/// From `--image`: the image's root filesystem as the template's base layer, converted
/// once (the build cache's, shared by every template of the same image and disk size).
pub(super) fn image_base(a: &BuildArgs, img: &Path) -> anyhow::Result<(PathBuf, FromImage)> {
    let t = Instant::now();
    let state_dir = std::path::absolute(&a.state_dir)?;
    let layout = image_layout(&img.to_string_lossy(), &state_dir)?;
    let src = clade_image::Source::open(&layout)?;
    let cache =
        clade_builder::layers::LayerCache::new(&TemplateStore::new(&state_dir).build_cache_dir());
    let (base, _key, converted) =
        crate::cli::progress::converting(|p| cache.image_base(&src, a.disk_size, p))
            .with_context(|| format!("the root filesystem of {}", img.display()))?;
    let Some(d) = converted else {
        eprintln!("image {}: converted before (cached)", img.display());
        return Ok((base, from_image(img.display().to_string(), src.defaults())));
    };
    eprintln!(
        "image {}: {} layers, {} entries, {} MiB unpacked, a {} MiB ext4 disk in {:.2}s \
         (unpack {:.2}s, mkfs.ext4 {:.2}s, import {:.2}s)",
        img.display(),
        d.unpacked.layers,
        d.unpacked.entries,
        d.unpacked.bytes >> 20,
        d.size >> 20,
        t.elapsed().as_secs_f64(),
        d.times[0].as_secs_f64(),
        d.times[1].as_secs_f64(),
        d.times[2].as_secs_f64()
    );
    Ok((base, from_image(img.display().to_string(), src.defaults())))
}

fn from_image(reference: String, d: &clade_image::ImageDefaults) -> FromImage {
    FromImage {
        reference,
        env: d.env.iter().cloned().collect(),
        cwd: d.cwd.clone(),
        user: d.user.clone(),
        start_cmd: d.start_command(),
    }
}

/// From `--dockerfile`: its FROM image converted (once, cached), its steps run in build
/// VMs (each step's layer cached); the top layer is the template's base.
pub(super) fn dockerfile_base(
    a: &BuildArgs,
    df: &Path,
    spec: &VmSpec,
) -> anyhow::Result<(PathBuf, FromImage)> {
    use clade_builder::dockerfile::MAX_DOCKERFILE;
    let t = Instant::now();
    let state_dir = std::path::absolute(&a.state_dir)?;
    let len = std::fs::metadata(df)
        .with_context(|| format!("the Dockerfile {}", df.display()))?
        .len();
    if len > MAX_DOCKERFILE as u64 {
        bail!(
            "the Dockerfile {} is larger than {MAX_DOCKERFILE} bytes",
            df.display()
        );
    }
    let text = std::fs::read_to_string(df)
        .with_context(|| format!("reading the Dockerfile {}", df.display()))?;
    let parsed =
        clade_builder::dockerfile::parse(&text).with_context(|| format!("{}", df.display()))?;
    let mut args = std::collections::BTreeMap::new();
    for kv in &a.build_arg {
        match kv.split_once('=') {
            Some((k, v)) => args.insert(k.to_string(), v.to_string()),
            // `--build-arg NAME`: its value from this environment, as docker build does.
            None => match std::env::var(kv) {
                Ok(v) => args.insert(kv.clone(), v),
                Err(_) => {
                    bail!("--build-arg {kv}: no value given and no such environment variable")
                }
            },
        };
    }
    let context = match &a.context {
        Some(c) => std::path::absolute(c)?,
        None => std::path::absolute(df)?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("/")),
    };
    let from = parsed.base_image(&args)?;
    // FROM names a path (relative to the context) when one is there, else a registry
    // reference.
    let local = context.join(&from);
    let layout = if local.exists() {
        local
    } else if clade_image::is_reference(&from) {
        image_layout(&from, &state_dir)?
    } else {
        bail!(
            "FROM {from}: no image at {} and not a registry reference",
            local.display()
        );
    };
    let src = clade_image::Source::open(&layout).with_context(|| format!("FROM {from}"))?;
    let cache =
        clade_builder::layers::LayerCache::new(&TemplateStore::new(&state_dir).build_cache_dir());
    let (base, key, converted) =
        crate::cli::progress::converting(|p| cache.image_base(&src, a.disk_size, p))
            .with_context(|| format!("the root filesystem of {from}"))?;
    match converted {
        Some(d) => eprintln!(
            "FROM {from}: {} layers, {} MiB unpacked, a {} MiB ext4 disk in {:.2}s",
            d.unpacked.layers,
            d.unpacked.bytes >> 20,
            d.size >> 20,
            t.elapsed().as_secs_f64()
        ),
        None => eprintln!("FROM {from}: cached"),
    }
    let plan = parsed.plan(src.defaults(), &args)?;
    if a.test_device && !plan.steps.is_empty() {
        bail!(
            "{}: RUN and COPY need a Linux guest with clade-agent: the native test guest \
             (--test-device) answers only the agent's Hello and Ping",
            df.display()
        );
    }
    for i in &plan.ignored {
        eprintln!("ignored (no effect on a sandbox): {i}");
    }
    for u in &plan.unused_args {
        eprintln!("warning: --build-arg {u} is not declared by an ARG");
    }
    let mut bar = crate::cli::progress::StepsBar::new("build");
    let built =
        clade_builder::layers::build(&plan, &base, &key, Some(&context), &cache, spec, &mut bar);
    bar.finish(built.is_ok());
    let (top, report) = built?;
    eprintln!(
        "dockerfile {}: {} steps, {} cached, {} run{} in {:.2}s",
        df.display(),
        report.steps,
        report.cached,
        report.ran.len(),
        report
            .boot
            .map(|b| format!(" (build VM boot {:.2}s)", b.as_secs_f64()))
            .unwrap_or_default(),
        t.elapsed().as_secs_f64()
    );
    Ok((
        top,
        from_image(format!("{} (FROM {from})", df.display()), &plan.defaults),
    ))
}
