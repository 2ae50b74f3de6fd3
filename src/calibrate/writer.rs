//! The writer thread: files are written off the compute thread, handed over through a bounded
//! crossbeam channel, so the graph never waits on the disk (only, at worst, on a full queue).

use crate::collect::imatrix::Imatrix;
use crate::formats::imatrix as imatrix_file;
use anyhow::Result;
use crate::formats::saliency::Saliency;
use crate::collect::reap::LayerRouting;
use crate::collect::trace_rows::PendingUbatch;
use crate::formats::trace::{TraceFile, TraceHeader};
use crossbeam_channel::{bounded, Receiver, Sender};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use std::thread::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImatrixFormat {
    Gguf,
    Dat,
}

pub enum Job {
    /// `progress_at`: a rolling checkpoint of that many chunks, for the progress line once written
    Imatrix { path: PathBuf, state: Box<Imatrix>, format: ImatrixFormat, prompt_file: String, chunk_size: i32, progress_at: Option<u64> },
    Saliency { path: PathBuf, saliency: Box<Saliency> },
    /// starts the trace file (header with 0 rows)
    TraceCreate { path: PathBuf, header: TraceHeader },
    /// encodes the ubatches' `n` rows (ordering their candidates), appends them and rewrites
    /// the header; the emptied routing sets come back for reuse
    TraceUbatches { ubatches: Vec<PendingUbatch>, n: u64 },
    /// gives the trace its name (it starts under a temporary one; see TraceFile::publish)
    TracePublish,
    /// makes the writer thread panic (tests of a dead writer)
    #[cfg(test)]
    Panic,
    /// answered once every job before it is done
    Sync(Sender<()>),
}

pub struct Writer {
    tx: Option<Sender<Job>>,
    handle: Option<JoinHandle<Result<()>>>,
    /// emptied routing sets, back from the writer
    recycled: Receiver<Vec<LayerRouting>>,
    /// the first write error, as soon as it happens, for the compute thread to stop on
    failed: Arc<OnceLock<String>>,
    /// nanoseconds the writer spent ordering and encoding trace rows
    encoding: Arc<AtomicU64>,
    threads: usize,
    /// time the sender waited for room in the queue (the writer behind)
    blocked: std::cell::Cell<Duration>,
}

/// What the writer did, for the run's summary.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriterStats {
    /// threads encoding the trace's rows
    pub threads: usize,
    /// time spent ordering and encoding them (the disk writes not counted)
    pub encoding: Duration,
    /// time the compute thread waited for room in the writer's queue
    pub blocked: Duration,
}

/// The run stopped because a write failed; the writer's own error says which file and why.
#[derive(Debug)]
pub struct WriteFailed(pub String);

impl std::fmt::Display for WriteFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped: {}", self.0)
    }
}
impl std::error::Error for WriteFailed {}

impl Writer {
    pub fn spawn() -> Writer {
        Self::spawn_with(1)
    }

    /// A writer that encodes trace rows on `threads` threads in all (its own among them):
    /// where layers are offloaded the host's cores wait with the device, and one thread's
    /// encoding could fall behind a fast device.
    pub fn spawn_with(threads: usize) -> Writer {
        let (tx, rx) = bounded::<Job>(8);
        // a few batches of ubatches in flight
        let (back_tx, recycled) = bounded::<Vec<LayerRouting>>(32);
        let failed = Arc::new(OnceLock::new());
        let seen = failed.clone();
        let encoding = Arc::new(AtomicU64::new(0));
        let encoding_seen = encoding.clone();
        let handle = std::thread::Builder::new()
            .name("reap-writer".into())
            .spawn(move || -> Result<()> {
                let pool = (threads > 1).then(|| crate::collect::pool::Pool::new(threads));
                let mut first_err: Option<anyhow::Error> = None;
                let mut trace: Option<TraceFile> = None;
                let mut rows = Vec::new();
                for job in rx {
                    // after a failure the rest is dropped unwritten (a later checkpoint must not
                    // replace a good one with a state the trace no longer matches), but the
                    // queue keeps draining so the compute thread never blocks on a dead writer
                    if first_err.is_some() {
                        continue;
                    }
                    if let Err(e) = run_job(job, &mut trace, &mut rows, &back_tx, pool.as_ref(), &encoding_seen) {
                        let _ = seen.set(format!("{e:#}"));
                        first_err = Some(e);
                    }
                }
                first_err.map_or(Ok(()), Err)
            })
            .expect("spawning the writer thread");
        Writer { tx: Some(tx), handle: Some(handle), recycled, failed, encoding, threads: threads.max(1), blocked: Default::default() }
    }

    /// The first write error so far (the run should stop), or None.
    pub fn failure(&self) -> Option<WriteFailed> {
        self.failed.get().map(|e| WriteFailed(e.clone()))
    }

    /// The routing sets the writer has emptied since last asked.
    pub fn spare_routing(&self) -> impl Iterator<Item = Vec<LayerRouting>> + '_ {
        self.recycled.try_iter()
    }

    pub fn send(&self, job: Job) {
        if let Some(tx) = &self.tx {
            let t0 = Instant::now();
            let sent = tx.send(job);
            self.blocked.set(self.blocked.get() + t0.elapsed());
            if sent.is_err() {
                // the thread is gone (it panicked): say so instead of waiting on it
                let _ = self.failed.set("the writer thread ended unexpectedly".into());
            }
        }
    }

    /// Waits until everything queued so far has been written (or has failed).
    pub fn sync(&self) {
        let (tx, rx) = bounded(1);
        if let Some(q) = &self.tx {
            if q.send(Job::Sync(tx)).is_err() {
                let _ = self.failed.set("the writer thread ended unexpectedly".into());
            } else {
                // a writer that panicked leaves the job queued (the channel lives while we hold
                // its sender), so its answer would never come: look at the thread meanwhile
                loop {
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) if !self.handle.as_ref().is_none_or(|h| h.is_finished()) => continue,
                        Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                            let _ = self.failed.set("the writer thread ended unexpectedly".into());
                            break;
                        }
                        _ => break,
                    }
                }
            }
        }
    }

    /// Waits until everything queued is on disk; returns the first write error, else what the
    /// writer did.
    pub fn finish(mut self) -> Result<WriterStats> {
        self.tx.take();
        let stats = |w: &Writer| WriterStats { threads: w.threads, encoding: Duration::from_nanos(w.encoding.load(Ordering::Relaxed)), blocked: w.blocked.get() };
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(r)) => r.map(|()| stats(&self)),
            Some(Err(p)) => {
                let why = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
                Err(anyhow::anyhow!("the writer thread panicked: {why}"))
            }
            None => Ok(stats(&self)),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run_job(job: Job, trace: &mut Option<TraceFile>, rows: &mut Vec<u8>, back: &Sender<Vec<LayerRouting>>, pool: Option<&crate::collect::pool::Pool>, encoding: &AtomicU64) -> Result<()> {
    match job {
        Job::Imatrix { path, state, format, prompt_file, chunk_size, progress_at } => {
            for line in imatrix_file::partial_data_warnings(&state, format == ImatrixFormat::Dat) {
                crate::progress::eprintln(&line);
            }
            match format {
                ImatrixFormat::Gguf => imatrix_file::write_gguf(&path, &state, &prompt_file, chunk_size),
                ImatrixFormat::Dat => imatrix_file::write_dat(&path, &state, &prompt_file, chunk_size),
            }?;
            if let Some(at) = progress_at {
                crate::progress::note(at);
            }
            Ok(())
        }
        Job::Saliency { path, saliency } => saliency.write(&path),
        Job::TraceCreate { path, header } => {
            *trace = Some(TraceFile::create_staged(&path, header)?);
            Ok(())
        }
        Job::TracePublish => trace.as_mut().map_or(Ok(()), |t| t.publish()),
        Job::Sync(done) => {
            let _ = done.send(());
            Ok(())
        }
        Job::TraceUbatches { ubatches, n } => {
            let Some(t) = trace.as_mut() else { anyhow::bail!("trace rows before the trace file was created") };
            rows.clear();
            let t0 = Instant::now();
            crate::collect::trace_rows::encode_ubatches(&ubatches, pool, rows).map_err(|e| anyhow::anyhow!("{e}"))?;
            encoding.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            for u in ubatches {
                let _ = back.try_send(u.into_spare());
            }
            t.append(rows, n)
        }
        #[cfg(test)]
        Job::Panic => panic!("injected writer panic"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::trace::TraceHeader;

    /// A writer whose first file cannot be written: the error is visible to the compute thread
    /// at once, later jobs neither block nor write, and finish() returns the first error.
    #[test]
    fn a_failed_write_is_reported_at_once_and_never_blocks() {
        let dir = std::env::temp_dir().join(format!("reap-writer-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let w = Writer::spawn();
        let header = TraceHeader { layers: vec![0], n_expert: 4, k: 1, top_n: 2, n_tokens: 0, flags: 0 };
        w.send(Job::TraceCreate { path: dir.join("no-such-folder/trace.bin"), header: header.clone() });
        let t0 = std::time::Instant::now();
        while w.failure().is_none() {
            assert!(t0.elapsed().as_secs() < 10, "the failure never showed");
            std::thread::yield_now();
        }
        assert!(w.failure().unwrap().to_string().contains("no-such-folder"));
        // far more jobs than the channel holds: none blocks, none is written
        let later = dir.join("later.bin");
        for _ in 0..100 {
            w.send(Job::TraceUbatches { ubatches: Vec::new(), n: 1 });
        }
        w.send(Job::TraceCreate { path: later.clone(), header });
        let e = w.finish().unwrap_err();
        assert!(format!("{e:#}").contains("no-such-folder"), "{e:#}");
        assert!(!later.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A Sync queued behind a job that panics is answered by no one (the channel keeps it):
    /// sync() still returns, with the failure set, whichever came first.
    #[test]
    fn a_writer_that_panicked_does_not_hang_sync() {
        for pause in [0, 100] {
            let w = Writer::spawn();
            w.send(Job::Panic);
            std::thread::sleep(Duration::from_millis(pause));
            w.sync();
            assert!(w.failure().is_some_and(|f| f.0.contains("ended unexpectedly")), "pause {pause} ms");
        }
    }

    /// A writer thread that dies: sends return at once, the compute side sees the failure,
    /// and finish() returns an error instead of hanging or re-raising the panic.
    #[test]
    fn a_dead_writer_never_blocks_the_sender() {
        let w = Writer::spawn();
        w.send(Job::Panic);
        let t0 = std::time::Instant::now();
        // far more than the channel holds: each send fails fast once the thread is gone
        while w.failure().is_none() {
            w.send(Job::TraceUbatches { ubatches: Vec::new(), n: 0 });
            assert!(t0.elapsed().as_secs() < 10, "blocked or never noticed");
        }
        assert!(w.failure().unwrap().to_string().contains("ended unexpectedly"));
        let e = w.finish().unwrap_err();
        assert!(format!("{e:#}").contains("injected writer panic"), "{e:#}");
    }
}
