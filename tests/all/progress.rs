//! The progress line of a calibration: plain lines at every checkpoint in a log, the live
//! line under a pseudo-terminal (ending cleanly on success and on SIGINT), and output files
//! that do not depend on it.

use super::util::*;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[test]
fn plain_lines_at_every_checkpoint_and_the_same_files() {
    let (a, b) = (temp_dir("progress-plain"), temp_dir("progress-never"));
    let args = ["-c", "128", "-b", "128", "--chunks", "12", "-ofreq", "4"];
    let plain = run_ok(&mut calibrate_cmd(&a, &args));
    let never = run_ok(calibrate_cmd(&b, &args).args(["--progress", "never"]));
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(!err.contains(['\r', '\x1b']), "control characters in a log:\n{err:?}");
    let lines: Vec<&str> = err.lines().filter_map(|l| l.strip_prefix("progress: ")).collect();
    assert_eq!(lines.len(), 3, "one line per checkpoint (4, 8, 12):\n{err}");
    for (line, at) in lines.iter().zip([4u64, 8, 12]) {
        let f: Vec<&str> = line.split(", ").collect();
        assert_eq!(f.len(), 5, "{line}");
        let done: u64 = f[0].strip_suffix("/12 chunks").and_then(|d| d.parse().ok()).unwrap_or_else(|| panic!("{line}"));
        assert!(done >= at, "{line}");
        assert!(f[1].strip_suffix(" tok/s").is_some_and(|r| r.parse::<f64>().is_ok_and(|r| r > 0.0)), "{line}");
        assert!(f[2].starts_with("elapsed ") && f[3].starts_with("ETA "), "{line}");
        assert_eq!(f[4], format!("checkpoint at {at} written now"));
    }
    assert!(!String::from_utf8_lossy(&never.stderr).contains("progress"));
    for f in ["i.gguf", "i.reap.json"] {
        assert_same_bytes(&a.join(f), &b.join(f));
    }
    assert_eq!(plain.stdout, never.stdout);
}

/// A child whose stdout and stderr are a pseudo-terminal, and what it wrote there.
struct PtyRun {
    child: Child,
    rx: mpsc::Receiver<Vec<u8>>,
    out: Vec<u8>,
}

fn spawn_in_pty(mut cmd: Command) -> PtyRun {
    let (mut master, mut slave) = (0, 0);
    let ws = libc::winsize { ws_row: 40, ws_col: 200, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: openpty fills two new descriptors, which we own from here on.
    assert_eq!(unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &ws) }, 0);
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    cmd.stdin(Stdio::null()).stdout(slave.try_clone().unwrap()).stderr(slave);
    default_signals(&mut cmd);
    let child = cmd.spawn().unwrap();
    // our copies of the terminal end close here: reading ends when the child's do
    drop(cmd);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut f = std::fs::File::from(master);
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = f.read(&mut buf) {
            if tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    PtyRun { child, rx, out: Vec::new() }
}

impl PtyRun {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out).into_owned()
    }

    /// Reads until `pred` holds for the output so far.
    fn wait_for(&mut self, what: &str, pred: impl Fn(&str) -> bool) {
        let t0 = Instant::now();
        while !pred(&self.text()) {
            assert!(t0.elapsed().as_secs() < 120, "no {what} after 2 minutes:\n{}", self.text());
            match self.rx.recv_timeout(Duration::from_millis(50)) {
                Ok(b) => self.out.extend(b),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the run ended before {what}:\n{}", self.text()),
            }
        }
    }

    fn finish(mut self) -> (ExitStatus, String) {
        let status = self.child.wait().unwrap();
        self.out.extend(self.rx.iter().flatten());
        (status, self.text())
    }
}

/// What a terminal shows after `out`: its lines, and the cursor's column on the last one.
/// Handles what the program and the pty write: text, CR, LF, erase to end of line.
fn screen(out: &str) -> (Vec<String>, usize) {
    let mut lines: Vec<Vec<char>> = vec![Vec::new()];
    let (mut row, mut col) = (0, 0);
    let mut chars = out.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' => col = 0,
            '\n' => {
                row += 1;
                if lines.len() == row {
                    lines.push(Vec::new());
                }
            }
            '\x1b' => {
                // CSI: parameters, then one final letter
                assert_eq!(chars.next(), Some('['), "unexpected escape in {out:?}");
                let mut params = String::new();
                let fin = loop {
                    match chars.next() {
                        Some(p) if p.is_ascii_digit() || p == ';' => params.push(p),
                        other => break other,
                    }
                };
                assert_eq!((fin, params.as_str()), (Some('K'), ""), "only erase-to-end-of-line is expected");
                lines[row].truncate(col);
            }
            c => {
                let l = &mut lines[row];
                if l.len() <= col {
                    l.resize(col, ' ');
                    l.push(c);
                } else {
                    l[col] = c;
                }
                col += 1;
            }
        }
    }
    (lines.into_iter().map(|l| l.into_iter().collect()).collect(), col)
}

/// The bar's line on the final screen: exactly one (every redraw in place), whole.
fn the_bar_line(lines: &[String], out: &str) -> String {
    let is_bar = |l: &&String| l.split_once(" chunks, ").is_some_and(|(n, _)| n.split('/').all(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())));
    let bars: Vec<&String> = lines.iter().filter(is_bar).collect();
    assert_eq!(bars.len(), 1, "one progress line, redrawn in place:\n{}", lines.join("\n"));
    assert!(out.contains("\x1b[K"), "the line was not drawn live");
    bars[0].clone()
}

/// A calibration whose line is drawn from the start (not after two seconds).
fn without_delay(mut c: Command) -> Command {
    c.env("REAP_PROGRESS_DELAY_MS", "0");
    c
}

#[test]
fn live_line_under_a_terminal_ends_cleanly_on_success_and_on_sigint() {
    let d = temp_dir("progress-pty-ok");
    let (status, out) = spawn_in_pty(without_delay(calibrate_cmd(&d, &["-c", "128", "-b", "128", "--chunks", "24", "-ofreq", "8"]))).finish();
    assert!(status.success(), "{out}");
    let (lines, col) = screen(&out);
    assert_eq!((col, lines.last().map(String::as_str)), (0, Some("")), "the screen ends inside a line:\n{out:?}");
    let bar = the_bar_line(&lines, &out);
    assert!(bar.starts_with("24/24 chunks, ") && bar.contains(", ETA 0s, checkpoint at 24 written "), "{bar}");
    assert!(!bar.contains("stopped") && !bar.contains("interrupted"), "{bar}");

    let d = temp_dir("progress-pty-sigint");
    let mut run = spawn_in_pty(without_delay(calibrate_cmd(&d, &["-c", "128", "-b", "128", "-ofreq", "5", "--trace-out", "t.bin"])));
    run.wait_for("progress line with a checkpoint", |o| o.contains(" chunks, ") && o.contains("checkpoint at "));
    signal(&run.child, libc::SIGINT);
    let (status, out) = run.finish();
    assert_eq!(status.code(), Some(130), "{out}");
    let (lines, col) = screen(&out);
    assert_eq!((col, lines.last().map(String::as_str)), (0, Some("")), "the screen ends inside a line:\n{out:?}");
    let bar = the_bar_line(&lines, &out);
    assert!(bar.ends_with(", interrupted"), "{bar}");
    let last = lines.iter().rev().find(|l| !l.is_empty()).unwrap();
    assert!(last.starts_with("reap-imatrix: error: interrupted by SIGINT during chunk "), "{}", lines.join("\n"));
    run_ok(Command::new(ours()).current_dir(&d).args(["check", "--reap", "i.reap.json", "--imatrix", "i.gguf", "--trace", "t.bin"]));
}

/// eval (chunks per model) draws the same line; forced here with `--progress always` and no
/// delay, read back through the screen emulator.
#[test]
fn eval_shows_the_line_too() {
    let d = temp_dir("progress-eval");
    let model = fixture("qwen3moe");
    let o = run_ok(
        without_delay(Command::new(ours()))
            .current_dir(&d)
            .args(["eval", "--progress", "always", "--base"])
            .arg(&model)
            .arg("--model")
            .arg(&model)
            .arg("-f")
            .arg(corpus())
            .args(["-c", "128", "-b", "128", "--chunks", "16", "-t", "1"]),
    );
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    // a pipe, not a pty: no LF → CRLF translation, so the emulator's column is not checked;
    // the output ends with a whole line
    assert!(err.ends_with('\n'), "{err:?}");
    let (lines, _) = screen(&err.replace('\n', "\r\n"));
    // a finished line for the forward passes, and the per-chunk lines kept whole
    assert!(lines.iter().any(|l| l.starts_with("16/16 chunks, ") && l.contains("tok/s")), "{}", lines.join("\n"));
    assert!(lines.iter().any(|l| l.starts_with("chunk ")), "{}", lines.join("\n"));
}

/// prune counts bytes: forced and without delay, its line ends with the whole file written,
/// the output's own size.
#[test]
fn prune_counts_the_bytes_it_writes() {
    let d = temp_dir("progress-prune");
    let model = fixture("qwen3moe");
    // keep experts 0..16 of every MoE block
    let layers: Vec<serde_json::Value> = (0..4).map(|b| serde_json::json!({"layer": b, "keep": (0..16).collect::<Vec<u16>>()})).collect();
    let map = serde_json::json!({"format": "reap-keep-map", "version": 1, "method": "test", "k": 16, "layers": layers});
    std::fs::write(d.join("map.json"), map.to_string()).unwrap();
    let o = run_ok(without_delay(Command::new(ours())).current_dir(&d).args(["prune", "--progress", "always", "-m"]).arg(&model).args(["--keep-map", "map.json", "-o", "p.gguf"]));
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(err.ends_with('\n'), "{err:?}");
    let (lines, _) = screen(&err.replace('\n', "\r\n"));
    let size = std::fs::metadata(d.join("p.gguf")).unwrap().len() as f64 / (1u64 << 20) as f64;
    let whole = format!("prune: {size:.2}/{size:.2} MiB, ");
    assert!(lines.iter().any(|l| l.starts_with(&whole) && l.contains(" MiB/s")), "no line starting {whole:?}:\n{}", lines.join("\n"));
}
