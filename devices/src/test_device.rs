//! Test device for the project's bare-metal test guest (see `tests/native-guest`).
//!
//! It is only attached when the VM config asks for it. It gives the guest a way to report a
//! result code (and end the VM), and fixed registers to exercise port I/O, MMIO and interrupt
//! delivery end to end:
//!
//! | where            | access      | meaning                                                |
//! |------------------|-------------|--------------------------------------------------------|
//! | PIO `0xf4`       | write u32   | end the VM with this result code                       |
//! | PIO `0xf8`       | read u32    | [`TEST_MAGIC`]                                         |
//! | MMIO base + 0x0  | read u32    | [`TEST_MAGIC`]                                         |
//! | MMIO base + 0x8  | r/w u64     | scratch register                                       |
//! | MMIO base + 0x10 | write       | arm: raise the IRQ every [`IRQ_PERIOD`] until acked    |
//! | MMIO base + 0x18 | write       | ack: stop raising                                      |

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{BusDevice, Error, ExitNotifier, GuestExit, IrqLine};

/// First port of the PIO window.
pub const TEST_PIO_BASE: u64 = 0xf4;
/// Length of the PIO window (exit port 0xf4, magic port 0xf8).
pub const TEST_PIO_LEN: u64 = 8;
/// Length of the MMIO window.
pub const TEST_MMIO_LEN: u64 = 0x1000;
/// "CLAD", little endian.
pub const TEST_MAGIC: u32 = 0x434c_4144;
/// Re-raise period while armed: re-raising means a guest that missed an edge cannot hang.
pub const IRQ_PERIOD: Duration = Duration::from_millis(1);

/// Port I/O half: result code and magic.
pub struct TestPio {
    exit: ExitNotifier,
}

impl TestPio {
    /// Reports the guest's result code through `exit`.
    pub fn new(exit: ExitNotifier) -> Self {
        Self { exit }
    }
}

impl BusDevice for TestPio {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset == 4 {
            let bytes = TEST_MAGIC.to_le_bytes();
            let n = data.len().min(4);
            data[..n].copy_from_slice(&bytes[..n]);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 0 {
            let mut code = [0u8; 4];
            let n = data.len().min(4);
            code[..n].copy_from_slice(&data[..n]);
            (self.exit)(GuestExit::TestExit(u32::from_le_bytes(code)));
        }
    }
}

#[derive(Default)]
struct IrqState {
    armed: bool,
    stop: bool,
}

/// MMIO half: magic, scratch register and the periodic test interrupt.
pub struct TestMmio {
    scratch: u64,
    irq: Arc<(Mutex<IrqState>, Condvar)>,
    /// Disconnected when the irq thread has ended (None: it could not be started).
    irq_thread_done: Option<Receiver<()>>,
}

impl TestMmio {
    /// `irq` is a line the VMM registered as an irqfd. The thread that raises the
    /// interrupt runs on `runner` from here on (a VMM hands it a thread started ahead,
    /// [`snapshot::spawn_thread`] starts one), idle until the guest arms it: started by
    /// the vCPU thread at the guest's first arm, it would be a thread creation the vCPU's
    /// system-call filter forbids.
    pub fn new(irq_line: impl Into<IrqLine>, runner: snapshot::ThreadRunner) -> Self {
        let irq = Arc::new((Mutex::new(IrqState::default()), Condvar::new()));
        let shared = Arc::clone(&irq);
        let line = irq_line.into();
        let (done_tx, done) = mpsc::sync_channel::<()>(0);
        let irq_thread_done = runner(
            "clade-testirq".into(),
            Box::new(move || {
                let _done = done_tx;
                raise_while_armed(&shared, &line)
            }),
        )
        .map_err(|e| tracing::error!("test device: no irq thread: {e}"))
        .ok()
        .map(|()| done);
        Self {
            scratch: 0,
            irq,
            irq_thread_done,
        }
    }

    fn arm(&mut self) {
        let (lock, cv) = &*self.irq;
        lock.lock().unwrap_or_else(|e| e.into_inner()).armed = true;
        cv.notify_all();
    }

    fn ack(&mut self) {
        let (lock, _) = &*self.irq;
        lock.lock().unwrap_or_else(|e| e.into_inner()).armed = false;
    }
}

/// The irq thread: raises the interrupt every [`IRQ_PERIOD`] while armed, until stopped.
fn raise_while_armed(shared: &(Mutex<IrqState>, Condvar), line: &IrqLine) {
    let (lock, cv) = shared;
    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
    while !st.stop {
        if st.armed {
            if let Err(e) = line.trigger() {
                tracing::error!("test device: raising irq failed: {e}");
            }
            st = cv
                .wait_timeout(st, IRQ_PERIOD)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        } else {
            st = cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// What the MMIO half of the test device remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestMmioState {
    /// The scratch register.
    pub scratch: u64,
    /// Whether the periodic interrupt is armed.
    pub armed: bool,
}

impl<'a> snapshot::Persist<'a> for TestMmio {
    type State = TestMmioState;
    /// The interrupt eventfd (a KVM irqfd), and where the irq thread runs.
    type ConstructorArgs = (IrqLine, snapshot::ThreadRunner);
    type Error = Error;

    fn save(&self) -> Result<TestMmioState, Error> {
        let (lock, _) = &*self.irq;
        let armed = lock.lock().unwrap_or_else(|e| e.into_inner()).armed;
        Ok(TestMmioState {
            scratch: self.scratch,
            armed,
        })
    }

    fn restore(
        (irq, runner): (IrqLine, snapshot::ThreadRunner),
        state: &TestMmioState,
    ) -> Result<Self, Error> {
        let mut dev = TestMmio::new(irq, runner);
        dev.scratch = state.scratch;
        if state.armed {
            dev.arm();
        }
        Ok(dev)
    }
}

impl Drop for TestMmio {
    fn drop(&mut self) {
        let (lock, cv) = &*self.irq;
        lock.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        cv.notify_all();
        if let Some(done) = self.irq_thread_done.take() {
            // Only a disconnect arrives: the thread's body has returned.
            let _ = done.recv();
        }
    }
}

impl BusDevice for TestMmio {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset & !7 {
            0 => u64::from(TEST_MAGIC),
            8 => self.scratch,
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        let start = (offset & 7) as usize;
        for (i, b) in data.iter_mut().enumerate() {
            *b = bytes.get(start + i).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            8 => {
                let mut bytes = [0u8; 8];
                let n = data.len().min(8);
                bytes[..n].copy_from_slice(&data[..n]);
                self.scratch = u64::from_le_bytes(bytes);
            }
            0x10 => self.arm(),
            0x18 => self.ack(),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;
    use std::time::Instant;
    use vmm_sys_util::eventfd::EventFd;

    #[test]
    fn pio_reports_exit_code_and_magic() {
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        let mut pio = TestPio::new(Arc::new(move |e| *s.lock().unwrap() = Some(e)));
        let mut buf = [0u8; 4];
        pio.read(4, &mut buf);
        assert_eq!(u32::from_le_bytes(buf), TEST_MAGIC);
        pio.write(0, &7u32.to_le_bytes());
        assert_eq!(*seen.lock().unwrap(), Some(GuestExit::TestExit(7)));
    }

    #[test]
    fn mmio_scratch_and_periodic_irq_until_ack() {
        let evt = EventFd::new(libc_nonblock()).unwrap();
        let mut dev = TestMmio::new(evt.try_clone().unwrap(), snapshot::spawn_thread());
        dev.write(8, &0xdead_beef_u64.to_le_bytes());
        let mut buf = [0u8; 8];
        dev.read(8, &mut buf);
        assert_eq!(u64::from_le_bytes(buf), 0xdead_beef);
        dev.write(0x10, &[1]);
        let t = Instant::now();
        let mut total = 0;
        while total < 2 && t.elapsed() < Duration::from_secs(5) {
            if let Ok(n) = evt.read() {
                total += n;
            }
            thread::sleep(Duration::from_millis(1));
        }
        assert!(total >= 2, "irq should be re-raised while armed");
        dev.write(0x18, &[1]);
        thread::sleep(Duration::from_millis(5));
        let _ = evt.read();
        thread::sleep(Duration::from_millis(10));
        assert!(evt.read().is_err(), "no irq after ack");
    }

    #[test]
    fn scratch_and_armed_irq_survive_save_and_restore() {
        use snapshot::Persist;
        let evt = EventFd::new(libc_nonblock()).unwrap();
        let mut dev = TestMmio::new(evt.try_clone().unwrap(), snapshot::spawn_thread());
        dev.write(8, &0x1234_u64.to_le_bytes());
        dev.write(0x10, &[1]);
        let state = dev.save().unwrap();
        assert_eq!(
            state,
            TestMmioState {
                scratch: 0x1234,
                armed: true
            }
        );
        drop(dev);
        let evt2 = EventFd::new(libc_nonblock()).unwrap();
        let mut back = TestMmio::restore(
            (evt2.try_clone().unwrap().into(), snapshot::spawn_thread()),
            &state,
        )
        .unwrap();
        let mut buf = [0u8; 8];
        back.read(8, &mut buf);
        assert_eq!(u64::from_le_bytes(buf), 0x1234);
        let t = Instant::now();
        while evt2.read().is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "armed irq raised again"
            );
            thread::sleep(Duration::from_millis(1));
        }
        back.write(0x18, &[1]);
    }

    fn libc_nonblock() -> i32 {
        vmm_sys_util::eventfd::EFD_NONBLOCK
    }
}
