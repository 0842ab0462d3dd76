//! Freezing a [`Vm`]'s guest memory: the instant a fork's children and a copy-on-write
//! snapshot are made from. How it is frozen depends on what the memory is ([`FreezePlan`]);
//! the dirty log (KVM's and the VMM's own writes) says which pages changed since the last
//! freeze. Moving onto a spare shell at the freeze is in `spare_shell.rs`.

use std::sync::Arc;

use snapshot::memory_file::MemoryChain;

use super::Vm;
use crate::error::{Error, Result};
use crate::exit::VmExit;
use crate::saved::{SavedMachine, Steps};
use crate::vstate::kvm;
use crate::vstate::memory::{Backing, FrozenImage, MAX_FROZEN_LAYERS};

/// How [`Vm::freeze_memory`] freezes this VM's memory ([`Vm::freeze_plan`]).
pub(crate) enum FreezePlan {
    /// Its own memory (a memfd, or a frozen image plus the pages written since).
    InPlace,
    /// On the snapshot it was restored from (or last took): its memory files.
    OnSnapshot(MemoryChain),
}

impl Vm {
    /// Freezes guest memory (call paused, with the plan [`Vm::freeze_plan`] made, and its
    /// machine `saved` at this instant) and restarts the dirty log there: the instant a
    /// fork's children and a copy-on-write snapshot are made from. The VM runs on the
    /// returned image, copy-on-write; call [`Vm::unmap_retired_memory`] once it runs again.
    ///
    /// With a spare shell ([`Vm::give_shell`]) the VM moves onto it, mapped from the image
    /// ([`Vm::move_onto`]): the pause then costs the same whatever the guest touched.
    /// Without one (or should the move fail) its memory is mapped again in place
    /// ([`GuestRam::map_frozen`]), and KVM drops its mappings of every touched page in the
    /// pause.
    ///
    /// [`GuestRam::map_frozen`]: crate::vstate::memory::GuestRam::map_frozen
    pub(crate) fn freeze_memory(
        &mut self,
        plan: FreezePlan,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> Result<Arc<FrozenImage>> {
        if let FreezePlan::OnSnapshot(chain) = plan {
            return self.freeze_restored_memory(&chain, saved, steps);
        }
        let forked = matches!(self.ram.backing(), Backing::Forked(_));
        // Forked memory: the pages written since it was last frozen make the new layer.
        // A booted VM's memfd is frozen as it is: its dirty bits so far are in the frozen
        // base already, dropped below.
        let dirty = if forked {
            self.take_dirty()?;
            steps.done("dirty_log");
            Some(self.take_fork_carry())
        } else {
            None
        };
        let premapped = if forked {
            None
        } else {
            self.ahead_image.take()
        };
        let now = match premapped {
            Some(image) => Ok((image, true)),
            None => self.ram.image_now(dirty.as_deref()),
        };
        let (image, changed) = match now {
            Ok(i) => i,
            Err(e) => {
                if let Some(d) = dirty {
                    self.return_fork_carry(d);
                }
                return Err(e);
            }
        };
        if !changed {
            return Ok(image);
        }
        if forked {
            steps.done("copy_written");
        }
        if self.try_move(&image, saved, steps) {
            drop(self.take_fork_carry());
            return Ok(image);
        }
        if let Err(e) = self.ram.map_frozen(Arc::clone(&image)) {
            if let Some(d) = dirty {
                self.return_fork_carry(d);
            }
            return Err(e);
        }
        steps.done("freeze_memory");
        if !forked {
            // The dirty log restarts, cheaper after the freeze (KVM has no mapping of the
            // memory left to write-protect). Should reading it fail, the VM still runs on
            // the frozen image (same contents); only the caller's operation fails.
            self.take_dirty()?;
            drop(self.take_fork_carry());
            steps.done("dirty_log");
        }
        Ok(image)
    }

    /// Moves the VM onto its spare shell, if it has one, mapped from `image`; false if
    /// it has none or the move failed (the VM is then as it was; logged).
    fn try_move(
        &mut self,
        image: &Arc<FrozenImage>,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> bool {
        let Some(shell) = self.spare_shell.take() else {
            return false;
        };
        match self.move_onto(shell, image, saved, steps) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("moving the VM onto its spare shell failed ({e}): its memory is frozen in place");
                false
            }
        }
    }

    /// Whether [`Vm::freeze_memory`] can freeze this VM's memory, and how (why not, as the
    /// error). Memory restored from a snapshot needs that snapshot's files: they are
    /// opened here, before any pause.
    pub(crate) fn freeze_plan(&self) -> Result<FreezePlan> {
        if !self.dirty_tracking {
            return Err(Error::Snapshot(
                "this VM runs without dirty page tracking: its memory cannot be frozen (fork, \
                 copy-on-write snapshot)"
                    .into(),
            ));
        }
        match self.ram.backing() {
            Backing::Memfd(_) => Ok(FreezePlan::InPlace),
            Backing::Forked(image) if image.layers() < MAX_FROZEN_LAYERS => Ok(FreezePlan::InPlace),
            Backing::Forked(_) => Err(Error::Snapshot(format!(
                "this VM's memory has {MAX_FROZEN_LAYERS} layers from earlier forks and \
                 snapshots: take a full snapshot and restore it with the copy backend to \
                 start a new line"
            ))),
            Backing::Anonymous | Backing::FilePrivate => {
                let Some(lineage) = &self.lineage else {
                    return Err(Error::Snapshot(
                        "this VM's memory comes from a snapshot that cannot be the base of a \
                         diff (fetched from a store, or which pages were written since is no \
                         longer known: a fork or a failed snapshot consumed the dirty log): \
                         take a full snapshot and restore it to fork"
                            .into(),
                    ));
                };
                if let Some(removed) = self
                    .page_server
                    .as_ref()
                    .map(|ps| ps.stats().pages_removed)
                    .filter(|&n| n > 0)
                {
                    return Err(Error::Snapshot(format!(
                        "{removed} pages of this VM's memory were discarded since its restore: \
                         its snapshot no longer describes them; take a full snapshot and \
                         restore it to fork"
                    )));
                }
                Ok(FreezePlan::OnSnapshot(lineage.memory_chain()?))
            }
        }
    }

    /// [`Vm::freeze_memory`] of memory restored from a snapshot (`uffd`, `file`): the
    /// snapshot it matched ([`Vm::last_snapshot`], its files `chain`) and the pages
    /// written since.
    fn freeze_restored_memory(
        &mut self,
        chain: &MemoryChain,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> Result<Arc<FrozenImage>> {
        let dirty = self.take_dirty()?;
        steps.done("dirty_log");
        let layers = match self.ram.restored_layers(chain, &dirty) {
            Ok(l) => l,
            Err(e) => {
                // The dirty log was consumed: no diff on the old snapshot any more.
                self.lineage = None;
                return Err(e);
            }
        };
        steps.done("copy_written");
        // From here on the page server's pages come from the layers.
        if let Some(ps) = self.page_server.take() {
            match ps.stop(snapshot::page_server::StopMode::Detach) {
                Ok(_) => self.working_set_saved = true,
                Err(e) => tracing::warn!("page server stopped with an error ({e}) before a freeze"),
            }
            steps.done("stop_page_server");
        }
        let image = layers.into_image(self.ram.mem_bytes());
        if self.try_move(&image, saved, steps) {
            return Ok(image);
        }
        match self.ram.map_frozen(Arc::clone(&image)) {
            Ok(image) => {
                steps.done("freeze_memory");
                Ok(image)
            }
            Err(e) => {
                let why = format!("guest memory could not be mapped from its snapshot: {e}");
                tracing::error!("{why}: ending the VM");
                self.finish(VmExit::Crashed(why.clone()));
                Err(Error::Snapshot(why))
            }
        }
    }

    /// Unmaps, in the background, the mapping the last [`Vm::freeze_memory`] moved out of
    /// the guest's range, or tears down the KVM VM and mapping it moved away from (call
    /// once the VM runs again: see [`crate::vstate::memory::Retired`], [`RetiredVm`]).
    ///
    /// [`RetiredVm`]: super::spare_shell::RetiredVm
    pub(crate) fn unmap_retired_memory(&mut self) {
        if let Some(retired) = self.ram.take_retired() {
            retired.unmap_in_background();
        }
        if let Some(old) = self.retired_vm.take() {
            old.tear_down_in_background();
        }
    }

    /// The pages written since the last call (KVM's dirty log and the VMM's own writes),
    /// one bitmap per range. A forked VM also keeps them for its next fork (the pages it
    /// wrote since its memory was frozen).
    pub(crate) fn take_dirty(&mut self) -> Result<Vec<Vec<u64>>> {
        let mut dirty = kvm::take_dirty_log(&self.vm_fd, self.ram.ranges())?;
        for (d, v) in dirty.iter_mut().zip(self.ram.take_vmm_dirty()) {
            for (a, b) in d.iter_mut().zip(v) {
                *a |= b;
            }
        }
        // Pages the balloon discarded since and nobody touched again are not copied.
        if let Some(log) = self.devices.discard_log() {
            let left_out = super::discarded::leave_out_discarded(
                self.ram.ranges(),
                !matches!(self.ram.backing(), Backing::Memfd(_)),
                &log.take(),
                &mut dirty,
                &mut self.fork_carry,
            );
            if left_out > 0 {
                tracing::debug!(pages = left_out, "balloon: discarded pages left out");
            }
        }
        if matches!(self.ram.backing(), Backing::Forked(_)) {
            if self.fork_carry.is_empty() {
                self.fork_carry = dirty.clone();
            } else {
                for (d, v) in self.fork_carry.iter_mut().zip(&dirty) {
                    for (a, b) in d.iter_mut().zip(v) {
                        *a |= *b;
                    }
                }
            }
        }
        Ok(dirty)
    }

    /// The pages a forked VM wrote since its memory was last frozen (taken: the next fork
    /// starts a new count; give them back with [`Vm::return_fork_carry`] on failure).
    fn take_fork_carry(&mut self) -> Vec<Vec<u64>> {
        std::mem::take(&mut self.fork_carry)
    }

    /// Gives back what [`Vm::take_fork_carry`] took when a fork failed.
    fn return_fork_carry(&mut self, carry: Vec<Vec<u64>>) {
        self.fork_carry = carry;
    }
}
