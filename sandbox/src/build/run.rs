//! Running a build, on its own thread: the base (a registry image converted once, a
//! template's frozen disk, or this host's `base` for E2B's base image), the COPY steps'
//! files unpacked as plain files into the build context, the steps as cached layers in a
//! build VM, then the template VM with its start and ready commands and its snapshot. Its
//! outcome and log go into its record; a failed build leaves no template.

use clade_builder::layers::LayerCache;
use clade_builder::vm::{StartCmd, VmSpec};
use clade_image::ImageDefaults;
use sha2::{Digest, Sha256};

use super::steps::plan_of;
use super::*;
use crate::template::{FromImage, Template};

impl Builds {
    pub(super) fn run(&self, b: &Arc<Mutex<Build>>, id: &str, req: &StartRequest) {
        let log = |level: &'static str, m: &str| lock(b).log(level, m);
        let work = self.state_dir.join("build-jobs").join(id);
        let r = self.build(b, id, req, &work, &log);
        let _ = std::fs::remove_dir_all(&work);
        let mut g = lock(b);
        match r {
            Ok(t) => {
                g.status = BuildStatus::Ready;
                let line = format!("template {} built", t.name);
                drop(g);
                log("info", &line);
            }
            Err(e) => {
                tracing::warn!("build {id}: {e}");
                g.status = BuildStatus::Error;
                g.reason = Some(e.to_string());
                drop(g);
                log("error", &e.to_string());
            }
        }
        self.save(id, &lock(b));
    }

    fn build(
        &self,
        b: &Arc<Mutex<Build>>,
        id: &str,
        req: &StartRequest,
        work: &Path,
        log: &dyn Fn(&'static str, &str),
    ) -> Result<Template> {
        let cfg = self
            .config
            .clone()
            .ok_or_else(|| Error::BadRequest("builds are not configured".into()))?;
        let (template, name, tags, vcpus, mem_mib) = {
            let g = lock(b);
            (
                g.template.clone(),
                g.dir.clone(),
                g.tags.clone(),
                g.vcpus,
                g.mem_mib,
            )
        };
        let verr = |e: clade_builder::Error| match e {
            clade_builder::Error::StepFailed {
                line,
                text,
                status,
                output,
            } => Error::BadRequest(format!(
                "step {line} `{text}` failed ({status}){}",
                if output.is_empty() {
                    String::new()
                } else {
                    format!(":\n{output}")
                }
            )),
            e => Error::Vm(e.to_string()),
        };
        let cache = LayerCache::new(&self.templates().build_cache_dir());
        // Its layers are not pruned while it builds.
        let _hold = cache.hold().map_err(verr)?;
        // E2B's base image (the SDK's default base, and `from_base_image`): this host's
        // base template when it has one (`clade template build base`, E2B's shape: no
        // registry needed), but for a build of that template itself.
        let mut from_image = req.from_image.clone();
        let mut from_template = req.from_template.clone();
        if let Some(img) = from_image.as_deref().filter(|i| is_e2b_base_image(i)) {
            let local = template != BASE_TEMPLATE
                && self
                    .templates()
                    .resolve(BASE_TEMPLATE)
                    .and_then(|t| self.templates().get(&t))
                    .is_ok();
            if local {
                log(
                    "info",
                    &format!(
                        "{img}: E2B's base image; built on this host's template {BASE_TEMPLATE}"
                    ),
                );
                from_image = None;
                from_template = Some(BASE_TEMPLATE.to_string());
            }
        }
        // The base: a registry image converted once, or a template's frozen disk.
        let (base, key, defaults, reference) = match (&from_image, &from_template) {
            (Some(img), _) => {
                if !clade_image::is_reference(img) {
                    return Err(Error::BadRequest(format!(
                        "fromImage '{img}' is not a registry reference"
                    )));
                }
                log("info", &format!("pulling {img}"));
                let pulled = clade_image::pull(img, &self.state_dir.join("images"), None)
                    .map_err(|e| Error::BadRequest(format!("fromImage {img}: {e}")))?;
                let src = clade_image::Source::open(&pulled.layout)
                    .map_err(|e| Error::BadRequest(format!("fromImage {img}: {e}")))?;
                let (base, key, converted) =
                    cache.image_base(&src, cfg.disk_size, None).map_err(verr)?;
                log(
                    "info",
                    &format!(
                        "{img}: {}",
                        if converted.is_some() {
                            "converted"
                        } else {
                            "cached"
                        }
                    ),
                );
                (base, key, src.defaults().clone(), img.clone())
            }
            (None, Some(reference)) => {
                let t = &self.templates().resolve(reference)?;
                let tpl = self.templates().get(t)?;
                let snap = self.templates().snapshot_dir(t)?;
                let prepared = vmm::PreparedSnapshot::open(&snap, vmm::CpuCheck::default())
                    .map_err(|e| Error::Vm(format!("template {t}: {e}")))?;
                let layer = prepared.disk().map(|d| d.layer.clone()).ok_or_else(|| {
                    Error::BadRequest(format!("template {t} has no disk to build on"))
                })?;
                let mut h = Sha256::new();
                h.update(format!("template\0{t}\0{}", tpl.created_ms));
                let d = tpl.image.as_ref().map(|i| ImageDefaults {
                    env: i.env.clone().into_iter().collect(),
                    cwd: i.cwd.clone(),
                    user: i.user.clone(),
                    entrypoint: Vec::new(),
                    cmd: i.start_cmd.clone(),
                });
                (
                    layer,
                    hex(h.finalize()),
                    d.unwrap_or_default(),
                    format!("template {t}"),
                )
            }
            (None, None) => return Err(Error::BadRequest("no base".into())),
        };
        // The COPY steps' files, unpacked into one context (member names are relative to
        // the SDK's context directory).
        // The build's own directory is private: a local user reaches nothing of them.
        std::fs::create_dir_all(work).map_err(Error::io("creating", work))?;
        std::fs::set_permissions(work, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(Error::io("setting the mode of", work))?;
        let ctx = work.join("context");
        std::fs::create_dir_all(&ctx).map_err(Error::io("creating", &ctx))?;
        for s in &req.steps {
            if let Some(h) = &s.files_hash {
                let f = self.files_dir().join(format!("{h}.tar"));
                unpack_context(&f, &ctx)
                    .map_err(|e| Error::BadRequest(format!("the files of a COPY ({h}): {e}")))?;
            }
        }
        let plan = plan_of(&defaults, req)?;
        // A jailed build VM reads the layers below its own: a base just converted is
        // the service's alone until shared.
        share_chain(&cache, &base)?;
        let spec = VmSpec {
            exe: cfg.exe.clone(),
            kernel: cfg.kernel.clone(),
            initrd: cfg.initrd.clone(),
            cmdline: cfg.cmdline.clone(),
            vcpus,
            mem_mib,
            kvm_device: cfg.kvm_device.clone(),
            net: None,
            test_device: false,
            agent_timeout: Duration::from_secs(240),
            confine: cfg.confine.clone(),
            network: cfg.network.clone(),
        };
        let (top, report) = clade_builder::layers::build(
            &plan,
            &base,
            &key,
            Some(&ctx),
            &cache,
            &spec,
            &mut |l: &str| log("info", l),
        )
        .map_err(verr)?;
        log(
            "info",
            &format!(
                "{} steps, {} cached, {} run",
                report.steps,
                report.cached,
                report.ran.len()
            ),
        );
        // The template VM, in the template's own directory (an old template of that name
        // goes only now, its sandboxes checked gone when the build started).
        let store = self.templates();
        let dir = store.prepare(&name, true)?;
        let r = (|| {
            let overlay = dir.join("disk.cdsk");
            disk::ops::create_overlay(&overlay, &top)
                .map_err(|e| Error::Vm(format!("the template's disk: {e}")))?;
            let start = req.start_cmd.as_ref().map(|c| StartCmd {
                cmd: c.clone(),
                ready: req.ready_cmd.clone(),
                env: plan.defaults.env.clone(),
                cwd: plan.defaults.cwd.clone(),
                user: plan.defaults.user.clone(),
                ready_timeout: READY_TIMEOUT,
            });
            log("info", "starting the template VM");
            clade_builder::vm::snapshot_template(
                &spec,
                &dir,
                Some(&overlay),
                &[],
                start.as_ref(),
                &store.snapshot_dir(&name)?,
            )
            .map_err(verr)?;
            let boot = store.keep_boot(&name, &cfg.kernel, cfg.initrd.as_deref(), &cfg.cmdline)?;
            let t = Template {
                name: name.clone(),
                vcpus,
                mem_mib,
                disk: true,
                test_guest: false,
                created_ms: crate::ids::now_ms(),
                setup: Vec::new(),
                // Its snapshot has the network device the build VM had.
                net: cfg.network.is_some(),
                image: Some(FromImage {
                    reference,
                    env: plan.defaults.env.iter().cloned().collect(),
                    cwd: plan.defaults.cwd.clone(),
                    user: plan.defaults.user.clone(),
                    start_cmd: req.start_cmd.iter().cloned().collect(),
                }),
                boot: Some(boot),
                build_id: Some(id.to_string()),
            };
            // Every jailed VM process reads the template and the layers it stands on.
            crate::vmproc::jail::share_tree(&dir)?;
            share_chain(&cache, &top)?;
            store.finish(&t)?;
            store.tag_build(&template, &name, &tags)?;
            Ok(t)
        })();
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        r
    }
}

/// Unpacks the tar `f` of a COPY's files into `ctx`, as host files that are no more than
/// files: owned by the service, no xattrs, and a device node, a FIFO or a set-id bit
/// refused (a COPY takes files, directories and symbolic links; the guest's set-id bits
/// are set by a RUN step), never made.
pub(super) fn unpack_context(f: &Path, ctx: &Path) -> std::result::Result<(), String> {
    let file = std::fs::File::open(f).map_err(|e| format!("opening {}: {e}", f.display()))?;
    let mut a = tar::Archive::new(clade_image::TarLimit::new(file));
    a.set_preserve_permissions(false);
    a.set_preserve_ownerships(false);
    a.set_unpack_xattrs(false);
    a.set_overwrite(true);
    for e in a.entries().map_err(|e| e.to_string())? {
        let mut e = e.map_err(|e| e.to_string())?;
        let path = String::from_utf8_lossy(&e.path_bytes()).into_owned();
        use tar::EntryType as T;
        let kind = e.header().entry_type();
        if matches!(kind, T::Char | T::Block | T::Fifo) {
            return Err(format!(
                "{path}: a device node or FIFO (a COPY takes files, directories and links)"
            ));
        }
        let mode = e.header().mode().map_err(|e| format!("{path}: {e}"))?;
        if mode & 0o6000 != 0 && kind != T::Symlink {
            return Err(format!(
                "{path}: set-uid/set-gid bits are not taken from a COPY's files (set them with \
                 a RUN chmod step)"
            ));
        }
        e.unpack_in(ctx).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

/// Makes the layers of the chain whose top is `top` that are in `cache` readable by every
/// jailed VM process, the directories down to them traversable, not listable. Only those
/// files: the cache also holds other builds' work (an image being unpacked into its
/// scratch, with the modes of the image's files), which a walk of the whole cache would
/// make readable to all.
pub(super) fn share_chain(cache: &LayerCache, top: &Path) -> Result<()> {
    let dir = std::fs::canonicalize(cache.dir()).map_err(Error::io("reading", cache.dir()))?;
    // The cache itself is traversed by every VM (share_files sets the directories below).
    let m = std::fs::metadata(&dir).map_err(Error::io("reading", &dir))?;
    if std::os::unix::fs::MetadataExt::mode(&m) & 0o011 != 0o011 {
        let mode = (std::os::unix::fs::MetadataExt::mode(&m) & 0o7777) | 0o111;
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .map_err(Error::io("setting the mode of", &dir))?;
    }
    let layers = disk::ops::info(top)
        .map_err(|e| Error::Vm(format!("the layers of {}: {e}", top.display())))?;
    let mut files = Vec::new();
    for l in layers {
        files.push(std::fs::canonicalize(&l.path).map_err(Error::io("reading", &l.path))?);
    }
    crate::vmproc::jail::share_files(&dir, &files)
}

/// The template `clade template build base` makes: what E2B's base image stands for here.
pub const BASE_TEMPLATE: &str = "base";

/// Whether `image` names E2B's base image (`e2bdev/base`, the SDK's default base), with or
/// without Docker Hub's host and the `latest` tag.
pub(super) fn is_e2b_base_image(image: &str) -> bool {
    let i = image
        .strip_prefix("docker.io/")
        .or_else(|| image.strip_prefix("index.docker.io/"))
        .or_else(|| image.strip_prefix("registry-1.docker.io/"))
        .unwrap_or(image);
    matches!(i, "e2bdev/base" | "e2bdev/base:latest")
}
