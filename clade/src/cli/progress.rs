//! Progress bars of long operations (copies, uploads): drawn on stderr only when it is a
//! terminal, so that scripts, pipes and `--json` get the same output as without them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar counting bytes, with rate and time left.
pub struct Bar(ProgressBar);

impl Bar {
    /// A bar of `len` bytes named `prefix` (hidden when stderr is not a terminal).
    pub fn bytes(prefix: &str, len: u64) -> Bar {
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{bar:30}] {percent:>3}% {binary_bytes}/{binary_total_bytes} \
             {binary_bytes_per_sec} ETA {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(prefix.to_string());
        Bar(bar)
    }

    /// The bar itself (to wrap a reader or writer).
    pub fn inner(&self) -> &ProgressBar {
        &self.0
    }

    /// Leaves the bar drawn at its end.
    pub fn finish(&self) {
        self.0.finish();
    }

    /// Updates the bar from `get` (done, total) ten times a second until
    /// [`Following::finish`].
    pub fn follow(&self, get: impl Fn() -> (u64, u64) + Send + 'static) -> Following {
        let stop = Arc::new(AtomicBool::new(false));
        let bar = self.0.clone();
        let thread = {
            let (stop, bar) = (stop.clone(), bar.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let (done, total) = get();
                    bar.set_length(total);
                    bar.set_position(done);
                    std::thread::sleep(Duration::from_millis(100));
                }
                get()
            })
        };
        Following {
            stop,
            thread: Some(thread),
            bar,
        }
    }
}

/// A bar updated by a thread.
pub struct Following {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<(u64, u64)>>,
    bar: ProgressBar,
}

impl Following {
    /// Stops following; the bar ends drawn at its last count (at 100 % when `ok` and the
    /// work counted everything), or is left where the work stopped.
    pub fn finish(mut self, ok: bool) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some((done, total)) = self.thread.take().and_then(|t| t.join().ok()) {
            self.bar.set_length(total);
            self.bar.set_position(done);
        }
        if ok {
            self.bar.finish();
        } else {
            self.bar.abandon();
        }
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
