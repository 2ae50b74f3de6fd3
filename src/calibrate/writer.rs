//! The writer thread: files are written off the compute thread, handed over through a bounded
//! crossbeam channel, so the graph never waits on the disk (only, at worst, on a full queue).

use crate::collect::imatrix::Imatrix;
use crate::formats::imatrix as imatrix_file;
use anyhow::Result;
use crossbeam_channel::{bounded, Sender};
use std::path::PathBuf;
use std::thread::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImatrixFormat {
    Gguf,
    Dat,
}

pub enum Job {
    Imatrix { path: PathBuf, state: Box<Imatrix>, format: ImatrixFormat, prompt_file: String, chunk_size: i32 },
}

pub struct Writer {
    tx: Option<Sender<Job>>,
    handle: Option<JoinHandle<Result<()>>>,
}

impl Writer {
    pub fn spawn() -> Writer {
        let (tx, rx) = bounded::<Job>(4);
        let handle = std::thread::Builder::new()
            .name("reap-writer".into())
            .spawn(move || -> Result<()> {
                let mut first_err = None;
                for job in rx {
                    let r = run_job(&job);
                    if let Err(e) = r {
                        // keep draining so the compute thread never blocks on a dead writer
                        first_err.get_or_insert(e);
                    }
                }
                first_err.map_or(Ok(()), Err)
            })
            .expect("spawning the writer thread");
        Writer { tx: Some(tx), handle: Some(handle) }
    }

    pub fn send(&self, job: Job) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
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

fn run_job(job: &Job) -> Result<()> {
    match job {
        Job::Imatrix { path, state, format, prompt_file, chunk_size } => match format {
            ImatrixFormat::Gguf => imatrix_file::write_gguf(path, state, prompt_file, *chunk_size),
            ImatrixFormat::Dat => imatrix_file::write_dat(path, state, prompt_file, *chunk_size),
        },
    }
}
