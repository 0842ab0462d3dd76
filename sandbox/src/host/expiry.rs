//! Timeouts: setting and extending a sandbox's end (`set_timeout`, `refresh`), and the
//! sweep that applies them ([`Host::expire`]: pause with auto-pause, else kill), plus
//! [`Host::reap`], which marks running sandboxes whose process ended as crashed.

use super::*;

impl Host {
    /// Sets the time left to `timeout_s` from now. 0 times a running sandbox out now: it
    /// is paused (auto-pause) or killed before this returns, as E2B does; `None` then
    /// means it was killed.
    pub fn set_timeout(&self, id: &str, timeout_s: u64) -> Result<Option<Record>> {
        if timeout_s == 0 {
            return self.time_out_now(id);
        }
        self.check_timeout(timeout_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        lifecycle::permit(Op::Extend, &rec)?;
        rec.end_ms = ids::now_ms() + (timeout_s as i64) * 1000;
        self.reg().update(&rec)?;
        Ok(Some(rec))
    }

    /// The timeout's action, now ([`Host::set_timeout`] with 0). A paused sandbox has
    /// nothing left to time out: it stays as it is.
    pub(super) fn time_out_now(&self, id: &str) -> Result<Option<Record>> {
        let lock = self.lock_of(id);
        let g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        lifecycle::permit(Op::TimeOut, &rec)?;
        if rec.state != State::Running {
            return Ok(Some(rec));
        }
        if rec.auto_pause {
            rec.end_ms = ids::now_ms();
            tracing::info!(sandbox = %id, "timeout set to 0: pausing");
            let how = timeout_pause(&rec);
            return self.pause_locked(rec, how).map(Some);
        }
        drop(g);
        tracing::info!(sandbox = %id, "timeout set to 0: killing");
        self.kill(id).map(|()| None)
    }

    /// Keeps the sandbox alive at least `duration_s` more (never shortens it).
    pub fn refresh(&self, id: &str, duration_s: u64) -> Result<Record> {
        self.check_timeout(duration_s)?;
        let lock = self.lock_of(id);
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut rec = self.load_owned(id)?;
        lifecycle::permit(Op::Extend, &rec)?;
        rec.end_ms = rec.end_ms.max(ids::now_ms() + (duration_s as i64) * 1000);
        self.reg().update(&rec)?;
        Ok(rec)
    }

    /// Marks running sandboxes whose VM process ended as crashed.
    pub fn reap(&self) -> Result<()> {
        let running: Vec<Record> = self
            .reg()
            .all()?
            .into_iter()
            .filter(|r| r.state == State::Running)
            .collect();
        for rec in running {
            let lock = self.lock_of(&rec.id);
            // Busy: an operation on it is under way and will see for itself.
            let Ok(_g) = lock.try_lock() else { continue };
            // (The registry guard must be gone before check_alive writes.)
            let fresh = self.reg().get(&rec.id)?;
            if let Some(fresh) = fresh {
                self.check_alive(fresh)?;
            }
        }
        Ok(())
    }

    /// Applies timeouts due at `now_ms`: pause (auto-pause) or kill. Returns the ids acted on.
    pub fn expire(&self, now_ms: i64) -> Result<Vec<String>> {
        let due: Vec<Record> = self
            .reg()
            .all()?
            .into_iter()
            .filter(|r| r.state == State::Running && r.end_ms <= now_ms)
            .collect();
        let mut done = Vec::new();
        for rec in due {
            let id = rec.id.clone();
            let r = if rec.auto_pause {
                let lock = self.lock_of(&id);
                let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
                // Re-read under the lock: a request may have extended or paused it.
                match self.load(&id) {
                    Ok(r) if r.state == State::Running && r.end_ms <= now_ms => {
                        let how = timeout_pause(&r);
                        self.fence(&r)
                            .and_then(|()| self.pause_locked(r, how))
                            .map(|_| ())
                    }
                    _ => continue,
                }
            } else {
                match self.load(&id) {
                    Ok(r) if r.state == State::Running && r.end_ms <= now_ms => self.kill(&id),
                    _ => continue,
                }
            };
            match r {
                Ok(()) => {
                    tracing::info!(sandbox = %id, "timed out ({})", if rec.auto_pause { "paused" } else { "killed" });
                    done.push(id);
                }
                Err(e) => tracing::warn!(sandbox = %id, "timeout: {e}"),
            }
        }
        Ok(done)
    }
}

/// How a sandbox's timeout pauses it (E2B's `autoPauseMemory`).
pub(super) fn timeout_pause(rec: &Record) -> PauseOptions {
    PauseOptions {
        keep_memory: rec.pause_keeps_memory,
        require_healthy_guest: false,
    }
}
