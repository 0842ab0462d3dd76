//! The lifecycle against a driver that keeps VM "processes" in a table (no KVM): states,
//! timeouts, pause/resume bookkeeping, forks, crashes and recovery after a restart.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI32, Ordering};

use super::*;
use crate::registry::SnapshotQuery;
use crate::template::Template;
use crate::vmproc::{ForkedChild, Started};

#[derive(Default)]
pub(crate) struct FakeDriver {
    next_pid: AtomicI32,
    pub alive: Mutex<HashSet<i32>>,
    pub log: Mutex<Vec<String>>,
    /// Diffs refused (as for a VM without a base snapshot).
    pub no_diff: std::sync::atomic::AtomicBool,
    /// Refuse full snapshots too.
    pub no_snapshot: std::sync::atomic::AtomicBool,
    /// What `snapshot_layers` says (0: nothing).
    pub layers: std::sync::atomic::AtomicUsize,
    /// Live forks refused (as for a VM whose memory cannot be frozen).
    pub no_live_fork: std::sync::atomic::AtomicBool,
    /// The TAP each start and fork child got (`--net` specs), in order.
    pub nets: Mutex<Vec<String>>,
    /// Live forks freeze a disk layer in the parent's directory and give each child an
    /// overlay on it, as the VMM does.
    pub fork_disks: std::sync::atomic::AtomicBool,
}

impl FakeDriver {
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
    /// Whether the driver did something starting with `what`.
    fn did(&self, what: &str) -> bool {
        self.log.lock().unwrap().iter().any(|l| l.starts_with(what))
    }
    /// What the driver did last.
    fn last_note(&self) -> String {
        self.log.lock().unwrap().last().cloned().unwrap_or_default()
    }
    pub(crate) fn crash(&self, pid: i32) {
        self.alive.lock().unwrap().remove(&pid);
    }
}

impl VmDriver for FakeDriver {
    fn start(&self, spec: &StartSpec) -> Result<Started> {
        if !spec.snapshot.exists() {
            return Err(Error::Vm(format!(
                "no snapshot {}",
                spec.snapshot.display()
            )));
        }
        let pid = 1000 + self.next_pid.fetch_add(1, Ordering::SeqCst);
        self.alive.lock().unwrap().insert(pid);
        match &spec.boot {
            Some(b) => self.note(format!(
                "boot {pid} {} disk={:?}",
                b.kernel.display(),
                spec.disk_overlay
            )),
            None => self.note(format!("start {pid} {}", spec.snapshot.display())),
        }
        self.nets.lock().unwrap().extend(spec.net.clone());
        Ok(Started {
            pid,
            api_sock: spec.api_sock.clone(),
        })
    }
    fn snapshot(&self, _api: &Path, dir: &Path, diff: bool) -> Result<()> {
        if self.no_snapshot.load(Ordering::SeqCst) {
            return Err(Error::VmApi {
                op: "snapshot",
                message: "disk full".into(),
            });
        }
        if diff && self.no_diff.load(Ordering::SeqCst) {
            return Err(Error::VmApi {
                op: "snapshot",
                message: "no base".into(),
            });
        }
        std::fs::create_dir_all(dir).unwrap();
        self.note(format!(
            "snapshot {} {}",
            if diff { "diff" } else { "full" },
            dir.display()
        ));
        Ok(())
    }
    fn snapshot_layers(&self, _api: &Path) -> Option<usize> {
        Some(self.layers.load(Ordering::SeqCst)).filter(|n| *n > 0)
    }
    fn set_vcpus_running(&self, api: &Path, running: bool) -> Result<()> {
        let op = if running { "unpause" } else { "pause" };
        self.note(format!("{op} {}", api.display()));
        Ok(())
    }
    fn stop(&self, pid: i32, _api: &Path) -> Result<()> {
        self.alive.lock().unwrap().remove(&pid);
        self.note(format!("stop {pid}"));
        Ok(())
    }
    fn fork(
        &self,
        _api: &Path,
        count: usize,
        prefix: &Path,
        _sync: bool,
        nets: &[String],
    ) -> Result<Vec<ForkedChild>> {
        if self.no_live_fork.load(Ordering::SeqCst) {
            return Err(Error::VmApi {
                op: "fork",
                message: format!("fork: this VM {}: ...", vmm::CANNOT_FORK_LIVE),
            });
        }
        self.nets.lock().unwrap().extend(nets.iter().cloned());
        let frozen = _api.with_file_name("disk-frozen.cdsk");
        if self.fork_disks.load(Ordering::SeqCst) && !frozen.exists() {
            disk::ops::create(
                &frozen,
                &disk::ops::CreateOptions {
                    virtual_size: Some(1 << 20),
                    ..Default::default()
                },
            )
            .unwrap();
            disk::ops::freeze(&frozen).unwrap();
        }
        Ok((1..=count)
            .map(|k| {
                let pid = 1000 + self.next_pid.fetch_add(1, Ordering::SeqCst);
                self.alive.lock().unwrap().insert(pid);
                let disk = self.fork_disks.load(Ordering::SeqCst).then(|| {
                    let o = prefix.join(format!("vm-f{k}.cdsk"));
                    disk::ops::create_overlay(&o, &frozen).unwrap();
                    o
                });
                ForkedChild {
                    pid,
                    api_sock: prefix.join(format!("vm-f{k}.api")),
                    vsock: Some(prefix.join(format!("vm-f{k}.vsock"))),
                    disk,
                }
            })
            .collect())
    }
    fn exited(&self, pid: i32, _api: &Path) -> Option<String> {
        (!self.alive.lock().unwrap().contains(&pid)).then(|| format!("pid {pid} gone"))
    }
}

pub(crate) fn state_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sandbox-host-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let store = TemplateStore::new(&d);
    let t = store.prepare("t", false).unwrap();
    std::fs::create_dir_all(t.join("snapshot")).unwrap();
    store
        .finish(&Template {
            name: "t".into(),
            vcpus: 2,
            mem_mib: 128,
            disk: false,
            test_guest: true,
            created_ms: 0,
            setup: vec![],
            net: false,
            image: None,
            boot: None,
            build_id: None,
        })
        .unwrap();
    d
}

pub(crate) fn host(name: &str) -> (Host, Arc<FakeDriver>, PathBuf) {
    let d = state_dir(name);
    let driver = Arc::new(FakeDriver::default());
    let h = Host::open(HostConfig::new(d.clone()), driver.clone()).unwrap();
    (h, driver, d)
}

fn req(timeout_s: u64) -> CreateRequest {
    CreateRequest {
        template: "t".into(),
        timeout_s,
        ..CreateRequest::default()
    }
}

#[test]
fn create_pause_resume_kill() {
    let (h, drv, d) = host("cycle");
    let r = h.create(req(60)).unwrap();
    assert_eq!(r.state, State::Running);
    assert_eq!((r.vcpus, r.mem_mib), (2, 128));
    assert!(r.dir.starts_with(d.join("sandboxes")));
    let pid = r.pid.unwrap();

    let p = h.pause(&r.id, PauseOptions::FULL).unwrap();
    assert_eq!(p.state, State::Paused);
    assert!(p.pid.is_none() && p.api_sock.is_none());
    assert_eq!(p.snapshot.as_deref(), Some(r.dir.join("pause-1").as_path()));
    assert!(
        drv.exited(pid, Path::new("")).is_some(),
        "a paused sandbox has no process"
    );
    assert!(matches!(
        h.pause(&r.id, PauseOptions::FULL),
        Err(Error::Conflict(_))
    ));
    // Only a diff was taken (the VM was restored from the template: it has a base), of
    // the VM paused first, and then it was stopped.
    let log = drv.log.lock().unwrap().clone();
    let at = |p: &str| log.iter().position(|l| l.starts_with(p)).unwrap();
    assert!(at("pause ") < at("snapshot diff"), "{log:?}");
    assert!(at("snapshot diff") < at("stop "), "{log:?}");
    assert!(!log.iter().any(|l| l.starts_with("unpause")), "{log:?}");

    let (c, resumed) = h.connect(&r.id, 30, false).unwrap();
    assert!(resumed);
    assert_eq!(c.state, State::Running);
    assert!(
        drv.log.lock().unwrap().last().unwrap().contains("pause-1"),
        "resumed from the pause"
    );
    let (_, resumed) = h.connect(&r.id, 30, false).unwrap();
    assert!(!resumed, "connect to a running sandbox does not resume it");
    assert!(matches!(
        h.resume(&r.id, 30, false),
        Err(Error::Conflict(_))
    ));

    // A VM whose chain is as long as a pause chain may get: a full snapshot, not a diff.
    drv.layers.store(PAUSE_CHAIN_MAX, Ordering::SeqCst);
    h.pause(&r.id, PauseOptions::FULL).unwrap();
    assert!(drv.did("snapshot full"));
    h.resume(&r.id, 30, false).unwrap();
    drv.log.lock().unwrap().clear();
    drv.layers.store(PAUSE_CHAIN_MAX - 1, Ordering::SeqCst);
    h.pause(&r.id, PauseOptions::FULL).unwrap();
    assert!(drv.did("snapshot diff"), "one below: a diff");
    h.resume(&r.id, 30, false).unwrap();
    drv.layers.store(0, Ordering::SeqCst);
    drv.log.lock().unwrap().clear();

    // The next pause numbers its snapshot on; a refused diff falls back to a full one.
    drv.no_diff.store(true, Ordering::SeqCst);
    let p2 = h.pause(&r.id, PauseOptions::FULL).unwrap();
    assert_eq!(
        p2.snapshot.as_deref(),
        Some(r.dir.join("pause-4").as_path())
    );
    assert!(drv.did("snapshot full"));
    let r2 = h.resume(&r.id, 30, false).unwrap();
    assert_eq!(r2.state, State::Running);

    // No snapshot at all: the pause fails, the VM is unpaused and runs on.
    drv.no_snapshot.store(true, Ordering::SeqCst);
    assert!(h.pause(&r.id, PauseOptions::FULL).is_err());
    assert!(drv.last_note().starts_with("unpause "));
    assert_eq!(h.get(&r.id).unwrap().state, State::Running);
    drv.no_snapshot.store(false, Ordering::SeqCst);

    h.kill(&r.id).unwrap();
    assert!(matches!(h.get(&r.id), Err(Error::NotFound(_))));
    assert!(!r.dir.exists());
    assert!(matches!(h.kill(&r.id), Err(Error::NotFound(_))));
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_requests_are_refused_before_anything_starts() {
    let (h, drv, d) = host("bad");
    assert!(matches!(h.create(req(0)), Err(Error::BadRequest(_))));
    assert!(matches!(
        h.create(req(10 * 86400)),
        Err(Error::BadRequest(_))
    ));
    let mut r = req(10);
    r.template = "nope".into();
    assert!(matches!(h.create(r), Err(Error::BadRequest(m)) if m.contains("nope")));
    let mut r = req(10);
    r.template = "../../etc".into();
    assert!(matches!(h.create(r), Err(Error::BadRequest(_))));
    assert!(drv.log.lock().unwrap().is_empty());
    assert!(matches!(h.get("../x"), Err(Error::NotFound(_))));
    assert!(matches!(
        h.pause("nosuchsandbox", PauseOptions::FULL),
        Err(Error::NotFound(_))
    ));
    let s = h.create(req(10)).unwrap();
    assert!(matches!(h.fork(&s.id, 0, 10), Err(Error::BadRequest(_))));
    assert!(matches!(h.fork(&s.id, 17, 10), Err(Error::BadRequest(_))));
    assert!(matches!(
        h.set_timeout(&s.id, 10 * 86400),
        Err(Error::BadRequest(_))
    ));
    let mut r = req(10);
    r.auto_resume = true;
    assert!(
        matches!(h.create(r), Err(Error::BadRequest(m)) if m.contains("auto-pause")),
        "auto-resume without auto-pause is refused"
    );
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn timeouts_kill_or_pause() {
    let (h, _drv, d) = host("timeouts");
    let killed = h.create(req(1)).unwrap();
    let mut ap = req(1);
    ap.auto_pause = true;
    let paused = h.create(ap).unwrap();
    let lives = h.create(req(100)).unwrap();
    let now = ids::now_ms();
    assert!(h.expire(now).unwrap().is_empty(), "nothing is due yet");
    let done = h.expire(now + 2000).unwrap();
    assert_eq!(done.len(), 2);
    assert!(matches!(h.get(&killed.id), Err(Error::NotFound(_))));
    assert_eq!(h.get(&paused.id).unwrap().state, State::Paused);
    assert_eq!(h.get(&lives.id).unwrap().state, State::Running);
    // A paused sandbox does not time out again; an extended one is not due.
    h.set_timeout(&lives.id, 1000).unwrap();
    assert!(h.expire(now + 5000).unwrap().is_empty());
    // refresh never shortens.
    let before = h.get(&lives.id).unwrap().end_ms;
    h.refresh(&lives.id, 1).unwrap();
    assert_eq!(h.get(&lives.id).unwrap().end_ms, before);
    // A timeout of 0 is the timeout's action now: pause for an auto-pausing sandbox (a
    // paused one stays paused), kill for the rest.
    let mut ap = req(100);
    ap.auto_pause = true;
    let pauses_now = h.create(ap).unwrap();
    let p = h.set_timeout(&pauses_now.id, 0).unwrap().unwrap();
    assert_eq!(p.state, State::Paused);
    assert_eq!(h.get(&pauses_now.id).unwrap().state, State::Paused);
    let again = h.set_timeout(&pauses_now.id, 0).unwrap().unwrap();
    assert_eq!(again.state, State::Paused);
    assert!(h.set_timeout(&lives.id, 0).unwrap().is_none());
    assert!(matches!(h.get(&lives.id), Err(Error::NotFound(_))));
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn forks_become_sandboxes() {
    let (h, drv, d) = host("fork");
    let mut r = req(60);
    r.metadata.insert("who".into(), "parent".into());
    let p = h.create(r).unwrap();
    let kids = h.fork(&p.id, 3, 30).unwrap();
    assert_eq!(kids.len(), 3);
    for k in &kids {
        assert_eq!(k.parent.as_deref(), Some(p.id.as_str()));
        assert_eq!(k.metadata.get("who").map(String::as_str), Some("parent"));
        assert_eq!(h.get(&k.id).unwrap().state, State::Running);
    }
    let (all, _) = h.list(&Query::default()).unwrap();
    assert_eq!(all.len(), 4);
    // A child pauses (full snapshot fallback is the driver's business) and resumes alone.
    h.pause(&kids[0].id, PauseOptions::FULL).unwrap();
    h.connect(&kids[0].id, 10, false).unwrap();
    // A VM that cannot fork live: the children restore a snapshot of the running parent.
    drv.no_live_fork.store(true, Ordering::SeqCst);
    let kids2 = h.fork(&p.id, 2, 30).unwrap();
    assert_eq!(kids2.len(), 2);
    for k in &kids2 {
        assert_eq!(k.state, State::Running);
        assert!(drv
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.starts_with(&format!("start {}", k.pid.unwrap())) && l.ends_with("/base")));
    }
    assert_eq!(
        h.get(&p.id).unwrap().state,
        State::Running,
        "the parent runs on"
    );
    // A paused parent cannot fork.
    h.pause(&p.id, PauseOptions::FULL).unwrap();
    assert!(matches!(h.fork(&p.id, 1, 10), Err(Error::Conflict(_))));
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Fork children stand on a disk layer frozen in their parent's directory: killing the
/// parent or a sibling keeps it (each child's whole chain still opens, a paused child
/// resumes), and it goes with the last sandbox that stands on it.
#[test]
fn killing_a_fork_parent_or_sibling_keeps_the_layers_the_others_stand_on() {
    let (h, drv, d) = host("fork-layers");
    drv.fork_disks.store(true, Ordering::SeqCst);
    let p = h.create(req(60)).unwrap();
    let kids = h.fork(&p.id, 2, 30).unwrap();
    let frozen = p.dir.join("disk-frozen.cdsk");
    let chain_opens = |k: &Record| {
        let top = h.get(&k.id).unwrap().disk.unwrap();
        disk::ops::info(&top)
            .map(|c| c.iter().any(|l| l.path == frozen))
            .unwrap_or(false)
    };
    assert!(kids.iter().all(chain_opens));
    h.kill(&p.id).unwrap();
    assert!(
        kids.iter().all(chain_opens),
        "the parent's kill took its children's layer"
    );
    h.pause(&kids[1].id, PauseOptions::FULL).unwrap();
    h.kill(&kids[0].id).unwrap();
    assert!(chain_opens(&kids[1]), "a sibling's kill took the layer");
    h.connect(&kids[1].id, 10, false).unwrap();
    h.kill(&kids[1].id).unwrap();
    assert!(!p.dir.exists(), "kept after the last sandbox on it went");
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A lookup that read a sandbox's row just before a pause ended its VM (no lock is taken
/// for a read) finds the process gone: the row the pause wrote stays paused, not crashed.
#[test]
fn a_lookup_racing_a_pause_leaves_the_sandbox_paused() {
    let (h, _drv, d) = host("lookup-pause");
    let a = h.create(req(60)).unwrap();
    let read_before = h.reg().get(&a.id).unwrap().unwrap();
    assert_eq!(read_before.state, State::Running);
    h.pause(&a.id, PauseOptions::FULL).unwrap();
    let seen = h.check_alive(read_before).unwrap();
    assert_eq!(seen.state, State::Paused);
    let got = h.get(&a.id).unwrap();
    assert_eq!((got.state, got.crash), (State::Paused, None));
    let (r, resumed) = h.connect(&a.id, 10, false).unwrap();
    assert!(resumed && r.state == State::Running);
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn crashes_show_and_a_restart_finds_everything_again() {
    let (h, drv, d) = host("restart");
    let a = h.create(req(60)).unwrap();
    let b = h.create(req(60)).unwrap();
    let c = h.create(req(60)).unwrap();
    h.pause(&b.id, PauseOptions::FULL).unwrap();
    drv.crash(c.pid.unwrap());
    // Found by a list (the sweep) as well as by a lookup.
    let (l, _) = h.list(&Query::default()).unwrap();
    assert_eq!(l.len(), 2);
    let got = h.get(&c.id).unwrap();
    assert_eq!(got.state, State::Crashed);
    assert!(got.crash.unwrap().contains("gone"));
    assert!(matches!(
        h.pause(&c.id, PauseOptions::FULL),
        Err(Error::Crashed { .. })
    ));
    // Lists leave crashed sandboxes out.
    let (l, _) = h.list(&Query::default()).unwrap();
    assert_eq!(l.len(), 2);
    drop(h);

    // "Restart": a new host on the same state dir and the same processes.
    let h = Host::open(HostConfig::new(d.clone()), drv.clone()).unwrap();
    assert_eq!(h.recover().unwrap(), (1, 1, 1));
    assert_eq!(h.get(&a.id).unwrap().pid, a.pid);
    let (r, resumed) = h.connect(&b.id, 10, false).unwrap();
    assert!(resumed && r.state == State::Running);
    // A crashed sandbox can be killed (removed).
    h.kill(&c.id).unwrap();
    assert!(matches!(h.get(&c.id), Err(Error::NotFound(_))));
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn templates_in_use_stay() {
    let (h, _drv, d) = host("tpl");
    let s = h.create(req(60)).unwrap();
    let store = TemplateStore::new(&d);
    assert!(matches!(
        store.remove("t", h.template_users("t").unwrap()),
        Err(Error::Conflict(_))
    ));
    h.kill(&s.id).unwrap();
    store.remove("t", h.template_users("t").unwrap()).unwrap();
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

fn from(template: &str) -> CreateRequest {
    CreateRequest {
        template: template.into(),
        ..req(60)
    }
}

#[test]
fn snapshots_become_templates_and_survive_a_restart() {
    let (h, drv, d) = host("snap");
    let src = h.create(req(60)).unwrap();
    let snap = h.snapshot(&src.id, None).unwrap();
    assert_eq!(snap.sandbox, src.id);
    assert_eq!(snap.template, "t");
    let snap_dir = d.join("sandboxes/snapshots").join(&snap.id);
    assert!(snap_dir.join("snapshot").is_dir());
    // A diff of the running VM, which runs on.
    assert!(drv
        .log
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.starts_with("snapshot diff") && l.ends_with(&format!("{}/snapshot", snap.id))));
    assert_eq!(h.get(&src.id).unwrap().state, State::Running);

    // A new sandbox from it, by id, with the default tag, and by name.
    let a = h.create(from(&snap.id)).unwrap();
    assert_eq!(a.template, snap.id);
    assert!(drv.last_note().ends_with(&format!("{}/snapshot", snap.id)));
    let b = h.create(from(&format!("{}:default", snap.id))).unwrap();
    assert!(matches!(
        h.create(from(&format!("{}:v2", snap.id))),
        Err(Error::BadRequest(_))
    ));
    let named = h.snapshot(&a.id, Some("mine")).unwrap();
    let c = h.create(from("mine")).unwrap();
    assert_eq!(c.template, named.id);
    // The snapshot of a snapshot's sandbox holds that snapshot.
    assert_eq!(named.template, snap.id);
    assert_eq!(
        h.template("mine").ok(),
        None,
        "names resolve only on create"
    );

    // A restart keeps them, and they still make sandboxes.
    drop(h);
    let h = Host::open(HostConfig::new(d.clone()), drv.clone()).unwrap();
    h.recover().unwrap();
    let (all, more) = h.list_snapshots(&SnapshotQuery::default()).unwrap();
    assert!(!more);
    assert_eq!(
        all.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [named.id.as_str(), snap.id.as_str()],
        "newest first"
    );
    let q = SnapshotQuery {
        sandbox: Some(src.id.clone()),
        ..SnapshotQuery::default()
    };
    assert_eq!(h.list_snapshots(&q).unwrap().0.len(), 1);
    h.create(from(&snap.id)).unwrap();
    // A paused sandbox resumes from its pause even when its template is a snapshot.
    h.pause(&b.id, PauseOptions::FULL).unwrap();
    h.connect(&b.id, 10, false).unwrap();
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn snapshot_errors() {
    let (h, drv, d) = host("snaperr");
    assert!(matches!(
        h.snapshot("nosuchsandbox", None),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        h.snapshot("../etc", None),
        Err(Error::NotFound(_))
    ));
    let s = h.create(req(60)).unwrap();
    assert!(matches!(
        h.snapshot(&s.id, Some("../x")),
        Err(Error::BadRequest(_))
    ));
    // A template's name is not a snapshot's.
    assert!(matches!(
        h.snapshot(&s.id, Some("t")),
        Err(Error::Conflict(_))
    ));
    assert!(matches!(
        h.delete_snapshot("snap-nosuchsnapshot"),
        Err(Error::SnapshotNotFound(_))
    ));
    assert!(matches!(h.delete_snapshot("t"), Err(Error::BadRequest(_))));
    assert!(matches!(
        h.create(from("snap-nosuchsnapshot")),
        Err(Error::BadRequest(_))
    ));
    // A crashed sandbox has nothing to snapshot.
    drv.crash(s.pid.unwrap());
    assert!(matches!(
        h.snapshot(&s.id, None),
        Err(Error::Crashed { .. })
    ));
    // Nothing was left behind by the refusals.
    let left = std::fs::read_dir(d.join("sandboxes/snapshots"))
        .map(|r| r.count())
        .unwrap_or(0);
    assert_eq!(left, 0);
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_paused_sandbox_snapshots_its_pause() {
    let (h, _drv, d) = host("snappaused");
    let s = h.create(req(60)).unwrap();
    let p = h.pause(&s.id, PauseOptions::FULL).unwrap();
    std::fs::write(p.snapshot.as_ref().unwrap().join("memory.mem"), b"pages").unwrap();
    let snap = h.snapshot(&s.id, None).unwrap();
    let copy = d
        .join("sandboxes/snapshots")
        .join(&snap.id)
        .join("snapshot/memory.mem");
    assert_eq!(std::fs::read(copy).unwrap(), b"pages");
    assert_eq!(h.get(&s.id).unwrap().state, State::Paused, "stays paused");
    let kid = h.create(from(&snap.id)).unwrap();
    assert_eq!(kid.state, State::Running);
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn deleted_snapshots_go_when_nothing_needs_them() {
    let (h, _drv, d) = host("snapgc");
    let src = h.create(req(60)).unwrap();
    let snap = h.snapshot(&src.id, Some("keep")).unwrap();
    let snap_dir = d.join("sandboxes/snapshots").join(&snap.id);
    let kid = h.create(from("keep:default")).unwrap();

    // The source is killed: its directory stays for the snapshot, its sockets go.
    h.kill(&src.id).unwrap();
    assert!(src.dir.exists());
    assert!(matches!(h.get(&src.id), Err(Error::NotFound(_))));
    // The template is held by the snapshot.
    assert!(h.template_users("t").unwrap() >= 1);

    // Deleted: gone from lists and creates at once, by name or id.
    h.delete_snapshot("keep:default").unwrap();
    assert!(h
        .list_snapshots(&SnapshotQuery::default())
        .unwrap()
        .0
        .is_empty());
    assert!(matches!(h.create(from("keep")), Err(Error::BadRequest(_))));
    assert!(matches!(
        h.delete_snapshot(&snap.id),
        Err(Error::SnapshotNotFound(_))
    ));
    // Its files stay while its sandbox runs (and resumes).
    assert!(snap_dir.exists());
    h.pause(&kid.id, PauseOptions::FULL).unwrap();
    h.connect(&kid.id, 10, false).unwrap();
    h.kill(&kid.id).unwrap();
    // Nothing needs it now: its files and its source's directory are gone.
    assert!(!snap_dir.exists());
    assert!(!src.dir.exists());
    assert_eq!(h.template_users("t").unwrap(), 0);

    // A name taken again: the new snapshot replaces the old one for new sandboxes.
    let s2 = h.create(req(60)).unwrap();
    let old = h.snapshot(&s2.id, Some("again")).unwrap();
    let new = h.snapshot(&s2.id, Some("again")).unwrap();
    assert_eq!(h.create(from("again")).unwrap().template, new.id);
    let (all, _) = h.list_snapshots(&SnapshotQuery::default()).unwrap();
    assert_eq!(all.len(), 1);
    // The old one is still needed by its source (whose next diff builds on it)...
    assert!(d.join("sandboxes/snapshots").join(&old.id).exists());
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn logs_of_a_sandbox_and_of_an_unknown_one() {
    let (h, _drv, d) = host("logs");
    let s = h.create(req(60)).unwrap();
    std::fs::write(
        s.dir.join("vm.log"),
        "2024-05-01T10:00:00.000000Z  WARN vmm: hello\n",
    )
    .unwrap();
    std::fs::write(s.dir.join("serial-r0.log"), "guest says hi\n").unwrap();
    let lines = h.logs(&s.id).unwrap();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0].text, "vmm: hello");
    assert_eq!(lines[1].text, "guest says hi");
    assert!(matches!(h.logs("nosuchsandbox"), Err(Error::NotFound(_))));
    assert!(matches!(h.logs("../../x"), Err(Error::NotFound(_))));
    drop(h);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Root only (it makes real namespaces, with a range of its own): a sandbox of a template
/// with a network device holds a network from create to kill, paused too; fork children get
/// their own; a policy follows the sandbox; networks nobody holds are swept by a restart.
#[test]
fn sandbox_networks_follow_the_lifecycle() {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root for network namespaces");
        return;
    }
    let d = state_dir("net");
    let store = TemplateStore::new(&d);
    let mut t = store.get("t").unwrap();
    t.net = true;
    store.finish(&t).unwrap();
    let range = hostnet::NetRange::new(
        hostnet::parse_cidr(&format!("10.253.{}.0/24", std::process::id() % 250)).unwrap(),
        &format!("sbt{}", std::process::id() % 10000),
        "sq",
    )
    .unwrap();
    let driver = Arc::new(FakeDriver::default());
    let mut h = Host::open(HostConfig::new(d.clone()), driver.clone()).unwrap();
    // Without networking, such a template's sandbox is refused with the reason.
    let err = h.create(req(60)).unwrap_err().to_string();
    assert!(err.contains("no sandbox networking"), "{err}");
    // The host's "resolver": answers each query with one A record, 10.9.8.<id's low
    // byte> (TTL 5), and a marker after the message.
    let upstream = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    std::thread::spawn(move || {
        use simple_dns::{rdata::RData, Packet, ResourceRecord, CLASS};
        let mut b = [0u8; 512];
        while let Ok((n, from)) = upstream.recv_from(&mut b) {
            let Ok(q) = Packet::parse(&b[..n]) else {
                continue;
            };
            let id = q.id();
            let name = q.questions[0].qname.clone();
            let mut a = q.into_reply();
            a.answers.push(ResourceRecord::new(
                name,
                CLASS::IN,
                5,
                RData::A(simple_dns::rdata::A {
                    address: u32::from_be_bytes([10, 9, 8, id as u8]),
                }),
            ));
            let mut answer = a.build_bytes_vec().unwrap();
            answer.extend_from_slice(b"resolved");
            let _ = upstream.send_to(&answer, from);
        }
    });
    // A query from inside network `i`'s namespace to its gateway: the answer.
    let ask = |i: u32, id: u16, name: &str| -> Vec<u8> {
        let mut q = simple_dns::Packet::new_query(id);
        q.questions.push(simple_dns::Question::new(
            simple_dns::Name::new_unchecked(name),
            simple_dns::QTYPE::TYPE(simple_dns::TYPE::A),
            simple_dns::QCLASS::CLASS(simple_dns::CLASS::IN),
            false,
        ));
        let q = q.build_bytes_vec().unwrap();
        hostnet::in_netns(&range.netns_path(i), move || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            s.send_to(&q, (hostnet::GUEST_GATEWAY, 53)).unwrap();
            let mut b = [0u8; 512];
            let n = s.recv(&mut b).unwrap();
            b[..n].to_vec()
        })
        .unwrap()
    };
    // The addresses learned in network `i` (its `dns_allowed` set, as nft lists it).
    let learned = |i: u32| -> String {
        hostnet::in_netns(&range.netns_path(i), || {
            let o = std::process::Command::new("nft")
                .args(["list", "set", "ip", "sandbox", "dns_allowed"])
                .output()
                .unwrap();
            assert!(o.status.success(), "{o:?}");
            String::from_utf8_lossy(&o.stdout).into_owned()
        })
        .unwrap()
    };
    let nets = crate::net::Networks::init(range.clone(), 1, Some(upstream_addr)).unwrap();
    h.set_networks(Ok(nets.clone()));
    h.recover().unwrap();

    let ns = |i: u32| range.netns_path(i);
    let mut r = req(60);
    r.egress = EgressPolicy::deny_all();
    let a = h.create(r).unwrap();
    let ia = a.net.expect("a network");
    assert!(ns(ia).exists());
    assert!(
        a.egress.as_deref().unwrap().contains("deny"),
        "{:?}",
        a.egress
    );
    assert_eq!(
        driver.nets.lock().unwrap().last().unwrap(),
        &format!("tap=tap0,netns={}", ns(ia).display())
    );
    assert_eq!(
        h.guest_ip(&a),
        Some(std::net::IpAddr::V4(range.outer_ip(ia)))
    );
    // DNS follows the policy: denied by default, a name is refused at the gateway.
    let answer = ask(ia, 0xab01, "foo.test");
    assert_eq!(&answer[..2], &[0xab, 0x01]);
    assert_eq!(answer[3] & 0x0f, 5, "REFUSED: {answer:?}");
    assert!(!answer.ends_with(b"resolved"));
    // A domain allowed: it resolves through the host's resolver, and what it resolved to
    // is in the namespace's learned set by the time the answer is back.
    let domains = EgressPolicy::from_e2b(false, &["*.allowed.test"], &[]).unwrap();
    let a = h.set_egress(&a.id, &domains).unwrap();
    assert!(!learned(ia).contains("10.9.8."), "{}", learned(ia));
    let answer = ask(ia, 0xab07, "pkg.allowed.test");
    assert!(answer.ends_with(b"resolved"), "{answer:?}");
    assert!(learned(ia).contains("10.9.8.7"), "{}", learned(ia));
    assert_eq!(ask(ia, 0xab02, "foo.test")[3] & 0x0f, 5);
    // Paused: the network stays (a resume reattaches to it).
    h.pause(&a.id, PauseOptions::FULL).unwrap();
    assert!(ns(ia).exists());
    let a = h.resume(&a.id, 60, false).unwrap();
    assert_eq!(a.net, Some(ia));
    let allow = EgressPolicy::from_e2b(true, &["10.1.2.3"], &["10.0.0.0/8"]).unwrap();
    let a = h.set_egress(&a.id, &allow).unwrap();
    assert_eq!(super::policy_of(&a).unwrap(), allow);
    // Allowed by default: every name resolves; a new policy forgot what was learned.
    assert!(ask(ia, 0xab03, "foo.test").ends_with(b"resolved"));
    assert!(!learned(ia).contains("10.9.8."), "{}", learned(ia));
    // Fork children: networks of their own, with the parent's policy.
    let kids = h.fork(&a.id, 2, 60).unwrap();
    let ik: Vec<u32> = kids.iter().map(|k| k.net.unwrap()).collect();
    assert!(ik.iter().all(|i| *i != ia && ns(*i).exists()) && ik[0] != ik[1]);
    assert_eq!(kids[0].egress, a.egress);
    // Kill: the network goes.
    h.kill(&kids[0].id).unwrap();
    assert!(!ns(ik[0]).exists());
    // A restart: the held ones are kept, one nobody holds (a crash's leftover) is swept.
    drop(h);
    let leaked = hostnet::SandboxNet::create(&range, 40).unwrap().leak();
    let mut h = Host::open(HostConfig::new(d.clone()), driver.clone()).unwrap();
    h.set_networks(Ok(
        crate::net::Networks::init(range.clone(), 0, None).unwrap()
    ));
    h.recover().unwrap();
    assert!(!ns(leaked).exists(), "swept");
    assert!(ns(ia).exists() && ns(ik[1]).exists(), "held ones kept");
    for id in [&a.id, &kids[1].id] {
        h.kill(id).unwrap();
    }
    assert!(!ns(ia).exists() && !ns(ik[1]).exists());
    nets.shutdown();
    hostnet::sweep(&range, &[]).unwrap();
    // The host table this test's range installed (a service leaves its own in place).
    hostnet::HostNet::init(&range).unwrap().remove().unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_image_env_is_under_the_requests_own() {
    let mut t = crate::template::Template {
        name: "img".into(),
        vcpus: 1,
        mem_mib: 64,
        disk: true,
        test_guest: false,
        created_ms: 0,
        setup: Vec::new(),
        net: false,
        image: None,
        boot: None,
        build_id: None,
    };
    let req: BTreeMap<String, String> = [("A".to_string(), "request".to_string())].into();
    assert_eq!(super::with_image_env(&t, req.clone()), req);
    t.image = Some(crate::template::FromImage {
        env: [("A", "image"), ("PATH", "/usr/bin")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        ..Default::default()
    });
    let env = super::with_image_env(&t, req);
    assert_eq!(env["A"], "request");
    assert_eq!(env["PATH"], "/usr/bin");
}

/// A template whose build recorded its boot (a kernel kept in its `boot/` directory).
fn booting_template(d: &Path) {
    let store = TemplateStore::new(d);
    let t = store.prepare("b", false).unwrap();
    std::fs::create_dir_all(t.join("snapshot")).unwrap();
    let kernel = d.join("vmlinux");
    std::fs::write(&kernel, b"a kernel").unwrap();
    let boot = store
        .keep_boot("b", &kernel, None, "console=ttyS0")
        .unwrap();
    store
        .finish(&Template {
            name: "b".into(),
            boot: Some(boot),
            ..store.get("t").unwrap()
        })
        .unwrap();
}

#[test]
fn a_filesystem_only_pause_drops_the_memory_and_the_next_wake_boots() {
    let (h, drv, d) = host("fs-pause");
    booting_template(&d);
    // A template that records no boot: refused before anything stops.
    let old = h.create(req(60)).unwrap();
    assert!(
        matches!(h.pause(&old.id, PauseOptions::FILESYSTEM), Err(Error::BadRequest(m)) if m.contains("records no boot"))
    );
    assert_eq!(h.get(&old.id).unwrap().state, State::Running);
    assert!(drv.alive.lock().unwrap().contains(&old.pid.unwrap()));

    let r = h
        .create(CreateRequest {
            template: "b".into(),
            ..req(60)
        })
        .unwrap();
    let pid = r.pid.unwrap();
    let p = h.pause(&r.id, PauseOptions::FILESYSTEM).unwrap();
    assert_eq!(p.state, State::Paused);
    assert!(p.memory_dropped && p.snapshot.is_none() && p.pid.is_none());
    assert!(
        !drv.alive.lock().unwrap().contains(&pid),
        "its VM process ended"
    );
    assert!(!drv.did("snapshot"), "no memory snapshot is taken");
    // Nothing to snapshot or fork while its memory is gone.
    assert!(matches!(h.snapshot(&r.id, None), Err(Error::Conflict(_))));
    assert!(matches!(h.fork(&r.id, 1, 60), Err(Error::Conflict(_))));
    // The registry keeps it across a restart.
    drop(h);
    let h = Host::open(HostConfig::new(d.clone()), drv.clone()).unwrap();
    assert!(h.get(&r.id).unwrap().memory_dropped);
    let (c, resumed) = h.connect(&r.id, 60, false).unwrap();
    assert!(resumed);
    assert_eq!(c.state, State::Running);
    assert!(!c.memory_dropped);
    assert!(drv.last_note().starts_with("boot "), "{}", drv.last_note());
    assert!(
        drv.last_note().contains("templates/b/boot/kernel"),
        "{}",
        drv.last_note()
    );
    // Paused with its memory again, it restores as before.
    h.pause(&r.id, PauseOptions::FULL).unwrap();
    h.connect(&r.id, 60, false).unwrap();
    assert!(drv.last_note().starts_with("start "), "{}", drv.last_note());
    // A reboot on resume drops the memory of a pause that kept it.
    h.pause(&r.id, PauseOptions::FULL).unwrap();
    let b = h.resume(&r.id, 60, true).unwrap();
    assert_eq!(b.state, State::Running);
    assert!(drv.last_note().starts_with("boot "), "{}", drv.last_note());
    // Its memory is not needed for a kill.
    h.pause(&r.id, PauseOptions::FILESYSTEM).unwrap();
    h.kill(&r.id).unwrap();
    assert!(matches!(h.get(&r.id), Err(Error::NotFound(_))));
}

#[test]
fn a_timeout_that_pauses_without_memory_drops_it() {
    let (h, drv, d) = host("fs-timeout");
    booting_template(&d);
    let r = h
        .create(CreateRequest {
            template: "b".into(),
            auto_pause: true,
            pause_drops_memory: true,
            ..req(1)
        })
        .unwrap();
    assert_eq!(h.expire(ids::now_ms() + 5_000).unwrap(), vec![r.id.clone()]);
    let p = h.get(&r.id).unwrap();
    assert_eq!(p.state, State::Paused);
    assert!(p.memory_dropped);
    assert!(!drv.did("snapshot"));
    // And set_timeout(0) of a running one likewise.
    h.connect(&r.id, 60, false).unwrap();
    h.set_timeout(&r.id, 0).unwrap();
    assert!(h.get(&r.id).unwrap().memory_dropped);
}

#[test]
fn a_pause_that_requires_a_healthy_guest_is_refused_when_its_agent_does_not_answer() {
    let (h, drv, _d) = host("strict-pause");
    // The fake VM has no agent at its vsock.
    let r = h.create(req(60)).unwrap();
    let strict = PauseOptions {
        require_healthy_guest: true,
        ..PauseOptions::FULL
    };
    assert!(matches!(
        h.pause(&r.id, strict),
        Err(Error::GuestUnresponsive { .. })
    ));
    assert_eq!(h.get(&r.id).unwrap().state, State::Running);
    assert!(
        !drv.did("snapshot") && !drv.did("pause"),
        "nothing was stopped"
    );
    // Not strict: paused as before.
    assert_eq!(
        h.pause(&r.id, PauseOptions::FULL).unwrap().state,
        State::Paused
    );
}
