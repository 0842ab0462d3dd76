//! Taking a snapshot of a running (or paused) VM: [`snapshot`].
//!
//! The vCPUs are paused (kicked out of KVM_RUN, pending I/O completed), devices stop their
//! background work, the machine is saved ([`Vm::save_machine`]), then the memory: every
//! page (full), or for a diff the pages KVM's dirty log and the VMM's own writes
//! (virtqueues, rx buffers: tracked by `vm-memory`'s bitmap) marked since the last
//! snapshot. The state file is written last and commits the snapshot.
//!
//! A full snapshot of a running VM whose memory can be frozen ([`Vm::freeze_memory`], as a
//! fork does) is *copy-on-write*: the pause only freezes the memory, and the memory file
//! is written from the frozen image after the vCPUs run again. The VM runs on the image
//! copy-on-write from then on, as a fork's parent does: a page it writes afterwards costs
//! a private copy while the image keeps the old one. A VM that is paused already gains
//! nothing from that and keeps its memory as it is. Otherwise, and for a diff, the memory
//! file is written while paused. Either way it is made durable (fsync, rename) after the
//! vCPUs run again, and the snapshot is complete when the call returns.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use snapshot::memory_file::{self, GuestRegion, PendingMemoryFile, RegionData};
use snapshot::state_file::{self, SnapshotMeta};
use snapshot::working_set::WorkingSet;
use snapshot::{SnapshotId, SnapshotKind};

use super::staging::{crash_point, Staging};
use super::{
    file_err, io_err, StatePayload, MAX_DIFF_CHAIN, MEMORY_FILE, STATE_FILE, WORKING_SET_FILE,
};
use crate::error::{Error, Result};
use crate::saved::{Lineage, Steps};
use crate::vm::{FreezePlan, Vm};
use crate::vstate::memory::{Backing, FrozenImage, HostRange};

/// What [`snapshot`] did.
#[derive(Debug, Clone)]
pub struct SnapshotInfo {
    /// The new snapshot's id.
    pub id: SnapshotId,
    /// Full or diff.
    pub kind: SnapshotKind,
    /// Its directory (absolute).
    pub dir: PathBuf,
    /// How long the vCPUs were paused (0 when the VM was paused already).
    pub pause_time: Duration,
    /// Whole call.
    pub total_time: Duration,
    /// Pages in the dirty bitmap (diff) or in guest memory (full).
    pub pages_considered: u64,
    /// Non-zero pages written to the memory file.
    pub pages_written: u64,
    /// Time steps, in order.
    pub steps: Vec<(&'static str, Duration)>,
}

/// Takes a snapshot of `vm`, running or paused, into `dir` (created if needed; a snapshot
/// already there is replaced once the new one is complete). `Diff` writes only the pages
/// written since the last snapshot this VM took or was restored from, and needs that
/// snapshot's directory to stay where it is. The VM keeps running afterwards (a paused VM
/// stays paused).
pub fn snapshot(vm: &mut Vm, dir: &Path, kind: SnapshotKind) -> Result<SnapshotInfo> {
    let t0 = Instant::now();
    let mut steps = Steps::new();
    vm.check_live("snapshot")?;
    let base = match kind {
        SnapshotKind::Full => None,
        SnapshotKind::Diff => {
            if !vm.dirty_tracking() {
                return Err(Error::Snapshot(
                    "a diff snapshot needs dirty page tracking, which this VM runs without".into(),
                ));
            }
            Some(vm.last_snapshot().cloned().ok_or_else(|| {
                Error::Snapshot(
                    "a diff snapshot needs a base: take a full snapshot of this VM first".into(),
                )
            })?)
        }
    };
    let dir = target_dir(dir)?;
    // Taken before anything below can stop the page server (a full snapshot fills memory).
    let carried = vm.first_touches();
    if let Some(l) = &base {
        if l.chain.len() + 2 > MAX_DIFF_CHAIN {
            return Err(Error::Snapshot(format!(
                "a diff would make a chain of {} snapshots (at most {MAX_DIFF_CHAIN}): \
                 take a full snapshot",
                l.chain.len() + 2
            )));
        }
        if l.dir == dir || l.chain.contains(&dir) {
            return Err(Error::Snapshot(format!(
                "{} holds this diff's base snapshot: write the diff elsewhere",
                dir.display()
            )));
        }
    }
    // Copy-on-write when possible (else written paused, as a diff always is).
    let copy_on_write = (kind == SnapshotKind::Full && vm.is_running())
        .then(|| vm.freeze_plan())
        .and_then(|p| {
            p.map_err(|e| tracing::debug!("full snapshot written paused: {e}"))
                .ok()
        });
    if kind == SnapshotKind::Full && vm.has_page_server() && copy_on_write.is_none() {
        // A full snapshot reads all of memory: install what the page server has not
        // served yet, while the guest still runs, then run on plain memory.
        if let Some(filled) = vm.fill_memory()? {
            tracing::debug!("page server stopped before a full snapshot: {filled} pages filled");
            steps.done("fill_memory");
        }
    }
    let id = SnapshotId::random();
    // Everything is written into a staging directory and put in place at the end: an
    // existing snapshot at `dir` survives any failure or kill before that.
    let staging = Staging::begin(&dir)?;
    let mut paused = vm.pause_guard("snapshot")?;
    steps.done("pause");
    let captured = capture(
        paused.vm(),
        staging.path(),
        kind,
        copy_on_write,
        id,
        base.as_ref(),
        &mut steps,
    );
    let pause_time = paused.release();
    steps.done("unpause");
    vm.unmap_retired_memory();
    let (memory, payload, pages_considered) = match captured {
        Ok(c) => c,
        Err(e) => {
            // The dirty log may have been consumed: only a full snapshot is safe now.
            vm.set_lineage(None);
            return Err(e);
        }
    };
    let committed = (|| -> Result<u64> {
        let pending = match memory {
            Memory::Written(p) => p,
            Memory::Frozen(image) => {
                let p = write_frozen(
                    &staging.path().join(MEMORY_FILE),
                    id,
                    vm.ram().ranges(),
                    &image,
                )
                .map_err(file_err(&dir))?;
                steps.done("write_memory");
                p
            }
        };
        let (header, stats) = pending.commit().map_err(file_err(&dir))?;
        steps.done("commit_memory");
        let meta = match &base {
            None => SnapshotMeta::full(id, header.mem_size),
            Some(b) => SnapshotMeta::diff(id, b.id, header.mem_size),
        };
        state_file::write(&staging.path().join(STATE_FILE), &meta, &payload)
            .map_err(file_err(&dir))?;
        steps.done("write_state");
        inherit_working_set(carried, vm.ram().mem_bytes(), staging.path(), id);
        crash_point("staged");
        staging.commit()?;
        steps.done("put_in_place");
        Ok(stats.pages_written)
    })();
    let pages_written = match committed {
        Ok(c) => c,
        Err(e) => {
            vm.set_lineage(None);
            return Err(e);
        }
    };
    vm.set_lineage(Some(Lineage {
        id,
        dir: dir.clone(),
        chain: payload.chain,
    }));
    let info = SnapshotInfo {
        id,
        kind,
        dir,
        pause_time,
        total_time: t0.elapsed(),
        pages_considered,
        pages_written,
        steps: steps.steps,
    };
    tracing::info!(
        "{kind} snapshot {id} in {}: {} pages written, paused {:?}, total {:?}",
        info.dir.display(),
        info.pages_written,
        info.pause_time,
        info.total_time
    );
    Ok(info)
}

/// Gives the snapshot `id` (staged in `dir`) of a VM whose memory is served on demand the
/// pages that VM's guest needed first (`carried`, [`Vm::first_touches`] taken when the
/// snapshot began: the working set its restore prefetched, or its first touches while
/// recording one), as the snapshot's own working set. Without it, the first restore of
/// every new snapshot records from nothing, faulting page by page: that is every wake of
/// a sandbox from its pause snapshot. The guest paused at the same kind of moment
/// (between requests) needs the same pages to answer its next request. Optional: a
/// working set that cannot be written is logged, and the snapshot's first restore
/// records one as before.
fn inherit_working_set(
    carried: Option<(u64, Vec<u64>)>,
    mem_bytes: u64,
    dir: &Path,
    id: SnapshotId,
) {
    let Some((page_count, pages)) = carried else {
        return;
    };
    if pages.is_empty() || page_count != mem_bytes / snapshot::PAGE_SIZE_U64 {
        return;
    }
    let n = pages.len();
    let ws = WorkingSet {
        id,
        page_count,
        pages,
    };
    match ws.save(&dir.join(WORKING_SET_FILE)) {
        Ok(()) => tracing::debug!(pages = n, "working set carried over to the snapshot"),
        Err(e) => tracing::warn!("carrying the working set over to the snapshot: {e}"),
    }
}

/// The memory of a snapshot as [`capture`] leaves it.
enum Memory {
    /// The memory file, written (not yet committed).
    Written(PendingMemoryFile),
    /// The frozen memory, for [`write_frozen`] once the VM runs again.
    Frozen(Arc<FrozenImage>),
}

/// Guest RAM ranges as regions of a memory file read from `fd`, which holds the memory
/// image from byte `at` (holes skipped).
fn image_fd_regions<'a>(ranges: &[HostRange], fd: BorrowedFd<'a>, at: u64) -> Vec<GuestRegion<'a>> {
    ranges
        .iter()
        .map(|r| GuestRegion {
            guest_addr: r.guest_addr,
            data: RegionData::Fd {
                fd,
                offset: at + r.image_offset,
                len: r.len as u64,
            },
        })
        .collect()
}

/// Bytes read at a time from a frozen layer.
const LAYER_CHUNK: u64 = 1 << 20;

/// A full memory file (not yet committed) of a frozen image: its base layer, then each
/// later layer's runs over it. Nothing writes the image's files, so this runs while the VM
/// does.
fn write_frozen(
    path: &Path,
    id: SnapshotId,
    ranges: &[HostRange],
    image: &FrozenImage,
) -> snapshot::Result<PendingMemoryFile> {
    let mut layers = image.parts();
    let Some((base, base_at, _)) = layers.next() else {
        return Err(snapshot::Error::InvalidInput(
            "a frozen image without layers".into(),
        ));
    };
    let mut pending = memory_file::write_full_pending(
        path,
        id,
        &image_fd_regions(ranges, base.as_fd(), base_at),
    )?;
    let mut buf = Vec::new();
    for (file, at, runs) in layers {
        for &(off, len) in runs {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(LAYER_CHUNK);
                buf.resize(n as usize, 0);
                file.read_exact_at(&mut buf, at + off + done)
                    .map_err(|source| snapshot::Error::Io {
                        op: "read a frozen memory layer",
                        path: path.to_path_buf(),
                        source,
                    })?;
                pending.overwrite(off + done, &buf)?;
                done += n;
            }
        }
    }
    Ok(pending)
}

/// Everything that needs the vCPUs and devices paused: the machine, and the memory file
/// written or the memory frozen.
#[allow(clippy::too_many_arguments)]
fn capture(
    vm: &mut Vm,
    dir: &Path,
    kind: SnapshotKind,
    copy_on_write: Option<FreezePlan>,
    id: SnapshotId,
    base: Option<&Lineage>,
    steps: &mut Steps,
) -> Result<(Memory, StatePayload, u64)> {
    let mut saved = vm.save_machine(steps)?;
    let mem_path = dir.join(MEMORY_FILE);
    let pages = vm.ram().mem_bytes() / snapshot::PAGE_SIZE_U64;
    let (memory, considered) = match (kind, base, copy_on_write) {
        (SnapshotKind::Full, _, Some(plan)) => {
            // Also restarts the dirty log: the next diff covers what changes after this.
            (
                Memory::Frozen(vm.freeze_memory(plan, &saved, steps)?),
                pages,
            )
        }
        (SnapshotKind::Full, _, None) => {
            if vm.dirty_tracking() {
                // Start a new interval: the next diff covers what changes after this.
                vm.take_dirty()?;
            }
            steps.done("dirty_log");
            let ram = vm.ram();
            let ranges = ram.ranges();
            let regions: Vec<GuestRegion<'_>> = match ram.backing() {
                Backing::Memfd(f) => image_fd_regions(ranges, f.as_fd(), 0),
                _ => (0..ranges.len())
                    .map(|i| GuestRegion {
                        guest_addr: ranges[i].guest_addr,
                        // SAFETY: vCPUs and devices are paused: nothing writes guest
                        // memory while the slices live (until this function returns).
                        data: RegionData::Slice(unsafe { ram.range_slice(i) }),
                    })
                    .collect(),
            };
            let p =
                memory_file::write_full_pending(&mem_path, id, &regions).map_err(file_err(dir))?;
            steps.done("write_memory");
            (Memory::Written(p), pages)
        }
        (SnapshotKind::Diff, Some(base), _) => {
            let dirty = vm.take_dirty()?;
            steps.done("dirty_log");
            let considered = dirty
                .iter()
                .flatten()
                .map(|w| u64::from(w.count_ones()))
                .sum();
            let ram = vm.ram();
            let ranges = ram.ranges();
            let regions: Vec<GuestRegion<'_>> = (0..ranges.len())
                .map(|i| GuestRegion {
                    guest_addr: ranges[i].guest_addr,
                    // SAFETY: as above: nothing writes guest memory while paused.
                    data: RegionData::Slice(unsafe { ram.range_slice(i) }),
                })
                .collect();
            let dirty_refs: Vec<&[u64]> = dirty.iter().map(|d| &d[..]).collect();
            let p = memory_file::write_diff_pending(&mem_path, id, base.id, &regions, &dirty_refs)
                .map_err(file_err(dir))?;
            steps.done("write_memory");
            (Memory::Written(p), considered)
        }
        (SnapshotKind::Diff, None, _) => {
            return Err(Error::Snapshot("a diff snapshot needs a base".into()))
        }
    };
    // Only now, with the memory written or frozen, the disk's current top layer becomes the
    // snapshot's (frozen, flushed); the VM runs on from a new overlay on it.
    saved.disk = vm.freeze_disk("s", steps)?;
    let chain = match base {
        None => Vec::new(),
        Some(b) => {
            let mut c = b.chain.clone();
            c.push(b.dir.clone());
            c
        }
    };
    Ok((memory, StatePayload { saved, chain }, considered))
}

/// The snapshot directory `dir` as an absolute path with its symlinks resolved (its parent
/// is created if needed; `dir` itself is made when the snapshot is put in place).
fn target_dir(dir: &Path) -> Result<PathBuf> {
    if dir.exists() {
        return dir
            .canonicalize()
            .map_err(io_err("resolving the snapshot directory"));
    }
    let name = dir
        .file_name()
        .ok_or_else(|| Error::Snapshot(format!("{}: not a directory name", dir.display())))?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(io_err("creating the snapshot's parent directory"))?;
    Ok(parent
        .canonicalize()
        .map_err(io_err("resolving the snapshot directory"))?
        .join(name))
}
