//! The writer thread: files are written off the compute thread, handed over through a bounded
//! crossbeam channel, so the graph never waits on the disk (only, at worst, on a full queue).

use crate::collect::imatrix::Imatrix;
use crate::formats::imatrix as imatrix_file;
use anyhow::Result;
use crate::formats::saliency::Saliency;
use crate::formats::trace::{TraceFile, TraceHeader};
use crossbeam_channel::{bounded, Receiver, Sender};
use std::path::PathBuf;
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
    /// appends encoded rows and rewrites the header; the buffer comes back for reuse
    TraceRows { rows: Vec<u8>, n: u64 },
    /// answered once every job before it is done
    Sync(Sender<()>),
}

pub struct Writer {
    tx: Option<Sender<Job>>,
    handle: Option<JoinHandle<Result<()>>>,
    /// emptied row buffers, back from the writer
    recycled: Receiver<Vec<u8>>,
}

impl Writer {
    pub fn spawn() -> Writer {
        let (tx, rx) = bounded::<Job>(8);
        let (back_tx, recycled) = bounded::<Vec<u8>>(8);
        let handle = std::thread::Builder::new()
            .name("reap-writer".into())
            .spawn(move || -> Result<()> {
                let mut first_err = None;
                let mut trace: Option<TraceFile> = None;
                for job in rx {
                    let r = run_job(job, &mut trace, &back_tx);
                    if let Err(e) = r {
                        // keep draining so the compute thread never blocks on a dead writer
                        first_err.get_or_insert(e);
                    }
                }
                first_err.map_or(Ok(()), Err)
            })
            .expect("spawning the writer thread");
        Writer { tx: Some(tx), handle: Some(handle), recycled }
    }

    /// An empty buffer for trace rows: a recycled one when the writer has returned any.
    pub fn row_buffer(&self) -> Vec<u8> {
        self.recycled.try_recv().unwrap_or_default()
    }

    pub fn send(&self, job: Job) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
        }
    }

    /// Waits until everything queued so far has been written (or has failed).
    pub fn sync(&self) {
        let (tx, rx) = bounded(1);
        if let Some(q) = &self.tx {
            if q.send(Job::Sync(tx)).is_ok() {
                let _ = rx.recv();
            }
        }
    }

    /// Waits until everything queued is on disk; returns the first write error.
    pub fn finish(mut self) -> Result<()> {
        self.tx.take();
        match self.handle.take().map(|h| h.join()) {
            Some(Ok(r)) => r,
            Some(Err(p)) => std::panic::resume_unwind(p),
            None => Ok(()),
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

fn run_job(job: Job, trace: &mut Option<TraceFile>, back: &Sender<Vec<u8>>) -> Result<()> {
    match job {
        Job::Imatrix { path, state, format, prompt_file, chunk_size, progress_at } => {
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
            *trace = Some(TraceFile::create(&path, header)?);
            Ok(())
        }
        Job::Sync(done) => {
            let _ = done.send(());
            Ok(())
        }
        Job::TraceRows { mut rows, n } => {
            let r = match trace.as_mut() {
                Some(t) => t.append(&rows, n),
                None => Err(anyhow::anyhow!("trace rows before the trace file was created")),
            };
            rows.clear();
            let _ = back.try_send(rows);
            r
        }
    }
}
