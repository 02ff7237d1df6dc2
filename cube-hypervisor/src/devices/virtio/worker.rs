//! Optional backend thread: polls a device's backend fds and moves input into the guest, so a
//! VMM without its own event loop gets rx traffic. `pause()` quiesces it for snapshots.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{MmioTransport, VirtioDevice};

/// Poll period while the device is busy: bounds how long the worker takes to notice that a vsock
/// host stream has room again (host streams are not polled for writability).
const TICK: Duration = Duration::from_millis(10);
/// Poll period once nothing has happened for `QUIET_TICKS` ticks. Changes to the set of fds to
/// watch come from guest notifications, which kick the wake-up fd, so an idle device needs no
/// fast tick: 100 wake-ups a second per device made hundreds of idle microVMs fill the CPUs.
const IDLE_TICK: Duration = Duration::from_millis(500);
const QUIET_TICKS: u32 = 20;

#[derive(Default)]
struct Ctl {
    paused: bool,
    parked: bool,
    stop: bool,
}

/// A thread calling [`MmioTransport::process_backend`] whenever the device's backend has input.
pub struct BackendWorker {
    ctl: Arc<(Mutex<Ctl>, Condvar)>,
    wake: Arc<EventFd>,
    handle: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for BackendWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendWorker").finish_non_exhaustive()
    }
}

fn lock(ctl: &Mutex<Ctl>) -> std::sync::MutexGuard<'_, Ctl> {
    ctl.lock().unwrap_or_else(|e| e.into_inner())
}

impl BackendWorker {
    /// Starts the worker for `transport` (running, not paused).
    pub fn spawn<D: VirtioDevice>(transport: Arc<Mutex<MmioTransport<D>>>) -> io::Result<Self> {
        Self::start(transport, false)
    }

    /// Starts the worker paused: it never touches the device before [`BackendWorker::resume`].
    /// Unlike `spawn` + `pause` this does not wait for the new thread to run (a restore on a
    /// busy host would otherwise wait for it to be scheduled).
    pub fn spawn_paused<D: VirtioDevice>(
        transport: Arc<Mutex<MmioTransport<D>>>,
    ) -> io::Result<Self> {
        Self::start(transport, true)
    }

    fn start<D: VirtioDevice>(
        transport: Arc<Mutex<MmioTransport<D>>>,
        paused: bool,
    ) -> io::Result<Self> {
        let ctl = Arc::new((
            Mutex::new(Ctl {
                paused,
                ..Ctl::default()
            }),
            Condvar::new(),
        ));
        let wake = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        transport
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .set_backend_wake(wake.clone());
        let (c, w) = (ctl.clone(), wake.clone());
        let handle = std::thread::Builder::new()
            .name("virtio-backend".into())
            .spawn(move || run(transport, c, w))?;
        Ok(BackendWorker {
            ctl,
            wake,
            handle: Some(handle),
        })
    }

    /// Stops touching the device; returns once the worker is parked.
    pub fn pause(&self) {
        let (m, cv) = &*self.ctl;
        let mut g = lock(m);
        g.paused = true;
        let _ = self.wake.write(1);
        while !g.parked && !g.stop {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Lets a paused worker continue.
    pub fn resume(&self) {
        let (m, cv) = &*self.ctl;
        lock(m).paused = false;
        cv.notify_all();
    }

    /// Stops and joins the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        {
            let (m, cv) = &*self.ctl;
            lock(m).stop = true;
            cv.notify_all();
        }
        let _ = self.wake.write(1);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for BackendWorker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn run<D: VirtioDevice>(
    transport: Arc<Mutex<MmioTransport<D>>>,
    ctl: Arc<(Mutex<Ctl>, Condvar)>,
    wake: Arc<EventFd>,
) {
    let mut quiet = 0u32;
    loop {
        {
            let (m, cv) = &*ctl;
            let mut g = lock(m);
            while g.paused && !g.stop {
                g.parked = true;
                cv.notify_all();
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            g.parked = false;
            if g.stop {
                return;
            }
        }
        let fds: Vec<RawFd> = {
            let t = transport.lock().unwrap_or_else(|e| e.into_inner());
            t.backend_fds()
        };
        let mut pfds: Vec<libc::pollfd> = fds
            .iter()
            .chain(std::iter::once(&wake.as_raw_fd()))
            .map(|&fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let tick = if quiet >= QUIET_TICKS {
            IDLE_TICK
        } else {
            TICK
        };
        // SAFETY: pfds is a valid array of pollfd of the given length for the whole call.
        let ready = unsafe {
            libc::poll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                tick.as_millis() as i32,
            )
        };
        quiet = if ready > 0 {
            0
        } else {
            quiet.saturating_add(1)
        };
        let _ = wake.read();
        let paused_or_stopped = {
            let g = lock(&ctl.0);
            g.paused || g.stop
        };
        if paused_or_stopped {
            continue;
        }
        let mut t = transport.lock().unwrap_or_else(|e| e.into_inner());
        t.process_backend();
    }
}
