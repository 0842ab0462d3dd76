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
        end_line(&self.0);
    }

    /// Updates the bar from `get` (done, total) ten times a second until
    /// [`Following::finish`].
    pub fn follow(&self, get: impl Fn() -> (u64, u64) + Send + 'static) -> Following {
        self.follow_steps(move || {
            let (done, total) = get();
            Some((None, done, total))
        })
    }

    /// As [`Bar::follow`], `get` naming the step the work is at too (the bar's prefix),
    /// or `None` while the work has not started (nothing is drawn then; a bar never
    /// started is not drawn at all).
    pub fn follow_steps(
        &self,
        get: impl Fn() -> Option<(Option<&'static str>, u64, u64)> + Send + 'static,
    ) -> Following {
        let stop = Arc::new(AtomicBool::new(false));
        let bar = self.0.clone();
        let thread = {
            let (stop, bar) = (stop.clone(), bar.clone());
            let show = move |bar: &ProgressBar| {
                let (step, done, total) = get()?;
                if let Some(s) = step {
                    bar.set_prefix(s);
                }
                bar.set_length(total);
                bar.set_position(done);
                Some((done, total))
            };
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    show(&bar);
                    std::thread::sleep(Duration::from_millis(100));
                }
                show(&bar)
            })
        };
        Following {
            stop,
            thread: Some(thread),
            bar,
        }
    }
}

/// Ends the line a bar left drawn (the terminal's cursor stays after its last
/// character): what is printed next starts on a line of its own. Nothing off a terminal.
fn end_line(bar: &ProgressBar) {
    if !bar.is_hidden() {
        eprintln!();
    }
}

/// Runs `convert` (an image's conversion to a disk) with a bar of its steps: the bytes of
/// the image's layers unpacked, then `mkfs.ext4`, then the import.
pub fn converting<T, E>(
    convert: impl FnOnce(Option<&clade_image::ConvertProgress>) -> Result<T, E>,
) -> Result<T, E> {
    let progress = Arc::new(clade_image::ConvertProgress::default());
    let bar = Bar::bytes("unpack", 0);
    let shown = {
        let p = progress.clone();
        bar.follow_steps(move || {
            let (step, done, total) = p.get()?;
            Some((Some(step.name()), done, total))
        })
    };
    let r = convert(Some(&progress));
    shown.finish(r.is_ok());
    r
}

/// A build's steps as a bar (built, of all, with the time left), its log lines printed
/// above it; on a terminal only, as every bar.
pub struct StepsBar(ProgressBar);

impl StepsBar {
    /// A bar named `prefix`.
    pub fn new(prefix: &str) -> StepsBar {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} steps, {elapsed} ETA {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(prefix.to_string());
        StepsBar(bar)
    }

    /// Leaves the bar drawn where the build ended (none for a plan with no steps).
    pub fn finish(&self, ok: bool) {
        if self.0.length().unwrap_or(0) == 0 {
            self.0.finish_and_clear();
            return;
        }
        if ok {
            self.0.finish();
        } else {
            self.0.abandon();
        }
        end_line(&self.0);
    }
}

impl clade_builder::layers::BuildEvents for StepsBar {
    fn line(&mut self, text: &str) {
        self.0.suspend(|| eprintln!("  {text}"));
    }

    fn steps(&mut self, done: usize, total: usize) {
        self.0.set_length(total as u64);
        self.0.set_position(done as u64);
    }
}

/// A bar updated by a thread.
pub struct Following {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Option<(u64, u64)>>>,
    bar: ProgressBar,
}

impl Following {
    /// Stops following; the bar ends drawn at its last count (at 100 % when `ok` and the
    /// work counted everything), or is left where the work stopped.
    pub fn finish(mut self, ok: bool) {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().and_then(|t| t.join().ok()) {
            Some(Some((done, total))) => {
                self.bar.set_length(total);
                self.bar.set_position(done);
            }
            Some(None) => {
                // The work never started (a conversion found in the cache).
                self.bar.finish_and_clear();
                return;
            }
            None => {}
        }
        if ok {
            self.bar.finish();
        } else {
            self.bar.abandon();
        }
        end_line(&self.bar);
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
