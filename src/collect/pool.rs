//! Worker threads for the eval callback's own work (the exact imatrix's Σx²). The callback runs
//! while ggml's threads (CPU) or the device (offloaded) wait for it, so its cores are free;
//! but it is called once per collected matmul, dozens of times per ubatch, so threads spawned
//! per call would cost more than they save on a many-core host. These are started once and
//! park between jobs.
//!
//! [`Pool::run`] runs `f(0) … f(parts - 1)` on the workers and the calling thread and returns
//! when all have returned; `f` may borrow from the caller's stack because of that wait (a
//! panic in a part is caught, the wait completed, and the panic resumed in the caller).
//!
//! The jobs of one callback come back to back, and waking a parked thread takes tens of
//! microseconds (measured on this 2-core machine: with parking alone, two threads were slower
//! than one), so a worker spins a while for the next job before it parks, and the caller spins
//! for the parts' end before it sleeps.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a thread spins for work (or for the parts' end) before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

/// Spins until `ready()` or `SPIN` has passed; returns whether `ready()`.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() > SPIN {
            return ready();
        }
    }
}

/// The job being run: `f` with its lifetime erased (sound because `run` waits for every part).
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn(usize) + Sync + 'static));
// SAFETY: `f` is Sync, and it outlives every use (see `run`).
unsafe impl Send for Job {}

#[derive(Default)]
struct State {
    job: Option<Job>,
    /// next part to hand out, parts of the job, parts finished
    next: usize,
    parts: usize,
    done: usize,
    panic: Option<Box<dyn std::any::Any + Send>>,
    quit: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    work: Condvar,
    finished: Condvar,
    /// jobs published so far, and parts of the current job finished: read while spinning
    jobs: AtomicU64,
    done: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // a part's panic is caught before it could poison the lock
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes parts of the current job and runs them until none is left.
    fn help<'a>(&'a self, mut s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        while let Some(job) = s.job.filter(|_| s.next < s.parts) {
            let p = s.next;
            s.next += 1;
            drop(s);
            // SAFETY: the job's `f` lives until `run` has seen every part done.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)(p) }));
            s = self.lock();
            if let Err(e) = r {
                s.panic.get_or_insert(e);
            }
            s.done += 1;
            self.done.store(s.done, Ordering::Release);
            if s.done == s.parts {
                self.finished.notify_all();
            }
        }
        s
    }
}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of `threads` in all: the caller and `threads - 1` workers.
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared::default());
        let workers = (1..threads.max(1))
            .map(|i| {
                let sh = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("reap-collect-{i}"))
                    .spawn(move || {
                        let mut s = sh.lock();
                        while !s.quit {
                            s = sh.help(s);
                            if s.quit {
                                break;
                            }
                            // spin for the next job, then park (the job counter is read again
                            // under the lock, so a job published meanwhile is not missed)
                            let seen = sh.jobs.load(Ordering::Acquire);
                            drop(s);
                            spin_until(|| sh.jobs.load(Ordering::Acquire) != seen);
                            s = sh.lock();
                            if sh.jobs.load(Ordering::Acquire) == seen && !s.quit {
                                s = sh.work.wait(s).unwrap_or_else(|e| e.into_inner());
                            }
                        }
                    })
                    .expect("starting a collection thread")
            })
            .collect();
        Pool { shared, workers }
    }

    /// Threads that run a job's parts, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(p)` for every `p` in `0..parts`, in any order and on any of the threads, and
    /// returns when all have returned.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        if parts <= 1 || self.workers.is_empty() {
            (0..parts).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is changed; the parts are all finished (below) before
        // this returns, and no worker touches the job after marking its part done.
        let job = Job(unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync + 'static)>(f) });
        let mut s = self.shared.lock();
        *s = State { job: Some(job), next: 0, parts, done: 0, panic: None, quit: false };
        self.shared.done.store(0, Ordering::Release);
        self.shared.jobs.fetch_add(1, Ordering::AcqRel);
        self.shared.work.notify_all();
        s = self.shared.help(s);
        if s.done < s.parts {
            drop(s);
            spin_until(|| self.shared.done.load(Ordering::Acquire) == parts);
            s = self.shared.lock();
        }
        while s.done < s.parts {
            s = self.shared.finished.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.job = None;
        if let Some(e) = s.panic.take() {
            drop(s);
            resume_unwind(e);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().quit = true;
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_part_runs_once_per_job_and_borrows_work() {
        let pool = Pool::new(3);
        for parts in [0, 1, 2, 3, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                pool.run(parts, &|p| {
                    hits[p].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50), "{parts} parts");
        }
    }

    #[test]
    fn a_panicking_part_reaches_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(4, &|p| assert!(p != 2, "part {p}"))));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(4, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 4);
    }
}
