//! A [`Vm`]'s spare shell: a pre-built KVM VM of its shape, given ahead
//! ([`Vm::give_shell`]), that the VM moves onto at its next freeze so that the freeze's
//! pause does not grow with the memory the guest touched; and the former KVM VM it leaves
//! behind ([`RetiredVm`]), torn down in the background. Also the shells made ready for a
//! fork's children ([`Vm::map_into_shell`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuFd, VmFd};

use super::Vm;
use crate::device_manager::Prewired;
use crate::error::{Error, Result};
use crate::saved::{SavedMachine, Steps};
use crate::vstate::memory::{Backing, FrozenImage, GuestRam};
use crate::vstate::shell::{Shell, ShellMemory};
use crate::vstate::spare::SpareThread;
use crate::vstate::state as kvm_state;

/// The step a freeze records when the VM moved onto its spare shell ([`Vm::give_shell`]):
/// how a fork's or a snapshot's report says the VM moved.
pub const MOVED_STEP: &str = "move";

/// Whether a freeze's report `steps` (a fork's or a snapshot's) say the VM moved onto its
/// spare shell.
pub fn moved(steps: &[(&'static str, Duration)]) -> bool {
    steps.iter().any(|(s, _)| *s == MOVED_STEP)
}

/// A pre-built shell a VM moves onto at its next freeze, made ready when it was given
/// ([`Vm::give_shell`]), so that the freeze's pause does little more than switch over.
pub(super) struct SpareShell {
    // Field order is drop order: vCPUs, then the VM, then the address space.
    vcpus: Vec<VcpuFd>,
    vm_fd: VmFd,
    memory: ShellMemory,
    cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    spares: Vec<SpareThread>,
    /// The devices wired to `vm_fd`.
    prewired: Prewired,
}

/// What a VM leaves behind when it moves onto a shell ([`Vm::move_onto`]): its former
/// KVM VM, vCPUs and memory mapping. Tearing them down costs in proportion to the memory
/// the guest touched (KVM drops its mappings of every page), so it happens in a thread of
/// its own, at idle priority, once the VM runs again.
pub(super) struct RetiredVm {
    vcpu_fds: Vec<VcpuFd>,
    vm_fd: VmFd,
    ram: GuestRam,
    spares: Vec<SpareThread>,
}

impl RetiredVm {
    /// After [`crate::vstate::memory::TEARDOWN_GRACE`], closes the KVM VM (KVM drops its
    /// mappings then, not on a later unmap) and then unmaps the memory a few MiB at a
    /// time, in a short-lived thread (here, at once, if none can be started).
    pub(super) fn tear_down_in_background(self) {
        let tear_down = move || {
            // Only on CPU time nothing else wants: right after a fork the children and the
            // parent need every CPU for their first requests.
            crate::vstate::spare::run_at_idle_priority("tearing down a former KVM VM");
            std::thread::sleep(crate::vstate::memory::TEARDOWN_GRACE);
            let t = Instant::now();
            let RetiredVm {
                vcpu_fds,
                vm_fd,
                ram,
                spares,
            } = self;
            drop(vcpu_fds);
            drop(vm_fd);
            let vm_closed = t.elapsed();
            ram.release_gradually();
            drop(spares);
            tracing::debug!(
                "former KVM VM closed in {vm_closed:?}, its memory mapping released in {:?}",
                t.elapsed() - vm_closed
            );
        };
        // Should no thread start, the closure is dropped with what it holds: torn down
        // here, at once.
        if let Err(e) = std::thread::Builder::new()
            .name("clade-retire".into())
            .spawn(tear_down)
        {
            tracing::warn!("no thread to tear down a former KVM VM ({e}): torn down here");
        }
    }
}

impl Vm {
    /// The shell a child of this VM's fork is built in (the shape [`Frozen::child`] asks
    /// for: this VM's memory and vCPUs, dirty pages logged), so one can be built ahead.
    ///
    /// [`Frozen::child`]: crate::fork::Frozen::child
    pub fn child_shell_spec(&self) -> crate::vstate::shell::ShellSpec {
        crate::vstate::shell::ShellSpec {
            kvm_device: self.config.kvm_device.clone(),
            mem_bytes: self.ram.mem_bytes(),
            vcpus: self.config.vcpus,
            dirty_log: true,
        }
    }

    /// The image a booted VM's next freeze takes, its memfd as it is: made once, when
    /// memory is first mapped ahead for it ([`Vm::map_ahead`]), so that every mapping
    /// made ahead (its spare shell's, children's shells') is of this very image, which
    /// the freeze then takes. `None` for memory of another kind.
    fn image_ahead(&mut self) -> Result<Option<Arc<FrozenImage>>> {
        if !matches!(self.ram.backing(), Backing::Memfd(_)) {
            return Ok(None);
        }
        if self.ahead_image.is_none() {
            self.ahead_image = Some(self.ram.image_now(None)?.0);
        }
        Ok(self.ahead_image.clone())
    }

    /// `memory` with this VM's next frozen image mapped over it where that image is known
    /// before the freeze (a booted VM's memfd; [`ShellMemory::Mapped`]); as it is for any
    /// other VM, whose image the freeze makes.
    fn map_ahead(&mut self, memory: ShellMemory) -> Result<ShellMemory> {
        let Some(image) = self.image_ahead()? else {
            return Ok(memory);
        };
        if memory
            .mapped_image()
            .is_some_and(|m| Arc::ptr_eq(m, &image))
        {
            return Ok(memory);
        }
        let ram = GuestRam::forked(memory.into_reservation()?, Arc::clone(&image))?;
        Ok(ShellMemory::Mapped(ram, image))
    }

    /// Makes `shell` (of this VM's shape, [`Vm::child_shell_spec`]) ready for a child of
    /// this VM's next fork: a booted VM's memory is mapped into it now, off the fork's
    /// path (~85 us per GiB of KVM walking the shell's memory slot, plus the mapping, that
    /// the child's build then skips); for any other VM it is returned as it is. A shell
    /// that a later fork's child gets, whose image is no longer the one mapped, has it
    /// replaced then.
    pub fn map_into_shell(&mut self, mut shell: Shell) -> Result<Shell> {
        let want = self.child_shell_spec();
        if *shell.spec() != want {
            return Err(Error::Config(format!(
                "a shell for {:?}, but a child of this VM needs {want:?}",
                shell.spec()
            )));
        }
        shell.memory = self.map_ahead(shell.memory)?;
        Ok(shell)
    }

    /// Moves this paused VM onto `shell`, a new KVM VM whose memory is `image` mapped
    /// private at a new address: the vCPUs' state (`saved`) and the in-kernel irqchip,
    /// PIT and clock are set there, the devices' interrupt lines switch to the eventfds
    /// registered there when the shell was given, the devices use the new mapping, and
    /// each vCPU thread runs the new VM's vCPU from now on. The
    /// devices themselves (with their host ends: sockets, connections, disk, TAP) and the
    /// threads stay, so the VM stays the same to whoever uses it.
    ///
    /// The former KVM VM and mapping are kept aside ([`RetiredVm`]), to be torn down
    /// once the VM runs again: nothing here costs in proportion to the memory the guest
    /// touched. Afterwards the guest faults in each page again on its first touch (a read
    /// maps the frozen page, a write copies it). On an error the VM is as it was: nothing
    /// changes it before the last, infallible step.
    pub(super) fn move_onto(
        &mut self,
        shell: SpareShell,
        image: &Arc<FrozenImage>,
        saved: &SavedMachine,
        steps: &mut Steps,
    ) -> Result<()> {
        let SpareShell {
            vcpus: vcpu_fds,
            vm_fd,
            memory,
            cpuids,
            spares,
            prewired,
        } = shell;
        let ram = memory.forked(image)?;
        ram.clear_vmm_dirty();
        steps.done("map_memory");
        kvm_state::restore_vm(&vm_fd, &saved.vm)?;
        // The last step that can fail.
        kvm_state::restore_vcpus(&vcpu_fds, &saved.vcpus, &cpuids, saved.machine.pvm_vif_base)?;
        steps.done("vcpu_state");
        // From here on nothing fails: the VM becomes the new one.
        self.devices.switch_irqs(prewired);
        self.devices.replace_memory(&ram.mem);
        let old_vcpu_fds = if self.vcpus.is_empty() {
            std::mem::replace(&mut self.pending_vcpus, vcpu_fds)
        } else {
            self.swap_vcpu_fds(vcpu_fds)
        };
        let old_vm_fd = std::mem::replace(&mut self.vm_fd, vm_fd);
        let old_ram = std::mem::replace(&mut self.ram, ram);
        self.retired_vm = Some(RetiredVm {
            vcpu_fds: old_vcpu_fds,
            vm_fd: old_vm_fd,
            ram: old_ram,
            spares,
        });
        steps.done(MOVED_STEP);
        Ok(())
    }

    /// Each paused vCPU thread runs `fds[i]` from now on; returns the fds they ran.
    fn swap_vcpu_fds(&mut self, fds: Vec<VcpuFd>) -> Vec<VcpuFd> {
        let jobs: Vec<_> = self
            .vcpus
            .iter()
            .zip(fds)
            .map(|(h, fd)| h.submit(move |v: &mut VcpuFd| std::mem::replace(v, fd)))
            .collect();
        let mut old = Vec::with_capacity(jobs.len());
        for (h, job) in self.vcpus.iter().zip(jobs) {
            // A vCPU thread of a paused VM runs its jobs; one that ended has no vCPU
            // left to swap (its VM is ending anyway).
            match job.and_then(|rx| h.wait_job(rx)) {
                Ok(fd) => old.push(fd),
                Err(e) => tracing::error!("moving a vCPU to the new VM: {e}"),
            }
        }
        old
    }

    /// Gives this VM a pre-built shell of its shape ([`Vm::child_shell_spec`]) to move
    /// onto at its next freeze (a fork, a copy-on-write snapshot), so that the freeze does
    /// not pause the guest while KVM drops its mappings of the memory (see
    /// [`crate::fork`]). The devices are wired to the shell here, outside any pause, and
    /// a booted VM's memory is mapped there (`Vm::map_ahead`). A freeze uses the
    /// shell up: give another one after it ([`Vm::has_spare_shell`]). Refused for a shell
    /// of another shape, or one the devices cannot be wired to or the memory not mapped
    /// over.
    pub fn give_shell(&mut self, shell: Shell) -> Result<()> {
        let want = self.child_shell_spec();
        if *shell.spec() != want {
            return Err(Error::Config(format!(
                "a spare shell for {:?}, but this VM needs {want:?}",
                shell.spec()
            )));
        }
        let Shell {
            vcpus,
            vm_fd,
            memory,
            cpuids,
            spares,
            ..
        } = shell;
        let prewired = self.devices.prewire(&vm_fd)?;
        let memory = self.map_ahead(memory)?;
        self.spare_shell = Some(SpareShell {
            vcpus,
            vm_fd,
            memory,
            cpuids,
            spares,
            prewired,
        });
        Ok(())
    }

    /// Whether the VM holds a spare shell for its next freeze ([`Vm::give_shell`]).
    pub fn has_spare_shell(&self) -> bool {
        self.spare_shell.is_some()
    }
}
