//! What a [`Vm`] made from saved state has besides its machine: finishing the restore
//! (vCPUs, vsock, the agent sync), the page server that serves its memory on demand (the
//! working set it records, filling what it never served), and the snapshot it matches.

use std::time::Duration;

use super::Vm;
use crate::error::{Error, Result};
use crate::exit::VmExit;
use crate::saved::{Lineage, RestoreReport, Steps};
use crate::seccomp::ThreadKind;

impl Vm {
    /// Writes the working set the page server recorded since the restore (the pages the
    /// guest touched, in order) next to the snapshot, so that later restores prefetch it.
    /// Call it once the guest has served its first request; a VM that never calls it saves
    /// everything it touched when it ends. A VM restored with a working set writes none:
    /// the pages it faulted in beyond it until now go into its next snapshot's
    /// ([`PageServer::first_touches`]). Returns the pages written (None: not recording).
    ///
    /// [`PageServer::first_touches`]: snapshot::page_server::PageServer::first_touches
    pub fn save_working_set(&mut self) -> Result<Option<usize>> {
        let Some(ps) = &self.page_server else {
            return Ok(None);
        };
        if self.working_set_saved {
            return Ok(None);
        }
        let n = ps
            .save_working_set()
            .map_err(|e| Error::Snapshot(format!("saving the working set: {e}")))?;
        self.working_set_saved = true;
        if let Some(n) = n {
            tracing::info!("working set saved: {n} pages");
        }
        Ok(n)
    }

    /// The outcome of the agent sync a restore started ([`crate::RestoreOptions::agent_sync`]):
    /// `Some` once, when it has finished (with how long it took, or why it failed).
    pub fn agent_sync_done(&mut self) -> Option<std::result::Result<Duration, String>> {
        let r = self.agent_sync.as_ref()?.try_recv();
        match r {
            Ok(r) => {
                self.agent_sync = None;
                Some(r)
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => None,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                self.agent_sync = None;
                Some(Err("the agent sync thread ended without an answer".into()))
            }
        }
    }

    pub(super) fn finish_working_set(&mut self) {
        if !self.working_set_saved {
            if let Err(e) = self.save_working_set() {
                tracing::warn!("{e}");
            }
        }
    }

    /// Stops the page server after installing every page it has not served yet, so the
    /// VM runs on plain memory (before a full snapshot reads all of it). If that fails,
    /// the pages not installed would read as zeros from now on: the VM is ended
    /// ([`VmExit::Crashed`]) rather than left running on memory it lost.
    pub(crate) fn fill_memory(&mut self) -> Result<Option<u64>> {
        let Some(ps) = self.page_server.take() else {
            return Ok(None);
        };
        match ps.stop(snapshot::page_server::StopMode::FillRemaining) {
            Ok(report) => {
                self.working_set_saved = true;
                Ok(Some(report.stats.pages_filled))
            }
            Err(e) => {
                let why = format!("guest memory could not be filled from the snapshot: {e}");
                tracing::error!("{why}: ending the VM");
                self.finish(VmExit::Crashed(why.clone()));
                Err(Error::Snapshot(why))
            }
        }
    }

    /// Sets the snapshot this VM's memory now matches (None: no diff possible until the
    /// next full snapshot).
    pub(crate) fn set_lineage(&mut self, lineage: Option<Lineage>) {
        self.lineage = lineage;
    }

    /// Records how the restore that made this VM went.
    pub(crate) fn set_restore_report(&mut self, report: RestoreReport) {
        self.restore_report = Some(report);
    }

    /// Finishes a VM built from saved state: starts the vCPUs if asked, then binds the
    /// vsock sockets (or moves `vsock_bound_ahead` into place) and starts the virtio
    /// workers (the vCPUs' first moments overlap with them), then with `agent_sync` gives
    /// the guest agent the time, fresh entropy and the hostname suffix in a background
    /// thread ([`Vm::agent_sync_done`] tells the outcome).
    pub(crate) fn finish_from_saved(
        &mut self,
        start: bool,
        agent_sync: Option<(Duration, Option<String>)>,
        vsock_bound_ahead: Option<crate::device_manager::BoundAhead>,
        steps: &mut Steps,
    ) -> Result<()> {
        // The shell's helper spare, if the devices left it.
        let sync_runner = (agent_sync.is_some() && self.config.vsock.is_some())
            .then(|| crate::vstate::spare::runner_for(&mut self.spares, ThreadKind::Helper));
        if start {
            self.start()?;
            steps.done("start");
        }
        self.devices.finish_restore(vsock_bound_ahead)?;
        steps.done("devices_finish");
        if let (Some((timeout, suffix)), Some(v), Some(runner)) =
            (agent_sync, &self.config.vsock, sync_runner)
        {
            let path = v.uds_path.clone();
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            runner(
                "agent-sync".into(),
                Box::new(move || {
                    let r = crate::agent::sync_after_restore(&path, timeout, suffix.as_deref());
                    let _ = tx.send(r);
                }),
            )
            .map_err(|source| Error::Io {
                context: "starting the agent sync thread",
                source,
            })?;
            self.agent_sync = Some(rx);
        }
        Ok(())
    }
}
