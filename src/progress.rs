//! The progress line of long commands: how far, how fast, how long still, and when the last
//! checkpoint was written. One bar at a time, process-wide, so that everything else printed to
//! stderr while it is shown (our messages, llama.cpp's log through `llama::log`) can step
//! around it instead of garbling it. Ground floor: imports nothing of the crate.
//!
//! # API (for every long command: calibration and replay now; prune, eval, corpus)
//!
//! ```text
//! let bar = progress::start(total, Unit::Rows);  // total 0: unknown (no ETA)
//! bar.set(done);                 // an atomic store: call it as often as is convenient
//! progress::add(n);              // the same as a counter, from code that has no handle
//! progress::note(at);            // a checkpoint holding the first `at` units was written
//! progress::eprintln("text");    // a line on stderr without garbling the bar (eprint: raw text)
//! bar.finish();                  // success
//! bar.abandon("interrupted");    // error or signal; dropping the Bar abandons it ("stopped")
//! ```
//!
//! Options, right after `start`: `.checkpoints()` (the command writes checkpoints: the line
//! says when the last was written, and plain lines come at each `note`), `.label("model 2/3")`,
//! `.detail(text)` (a figure of its own, e.g. tokens next to documents), `.quiet_on_terminal()`
//! (the command prints its own progress to stdout on the same terminal: no live line there).
//!
//! # What the user sees (`--progress auto|always|never`, default auto)
//!
//! - Live (auto with stderr a terminal, or always): one line redrawn in place (`\r`, text,
//!   erase to the end of the line), four times a second, cut to the terminal's width. It first
//!   appears after about two seconds (`REAP_PROGRESS_DELAY_MS` changes that, for tests), so
//!   short commands print nothing. Other stderr output erases it, prints, and redraws it
//!   below. It ends with a newline (final figures, and why it stopped when it did not finish),
//!   so no half-drawn line is left; a process killed by a signal while it is shown gets the
//!   newline from the signal handler (`interrupt`).
//! - Plain (auto with stderr not a terminal: logs, CI): whole lines, no control characters,
//!   `progress: ` and the same figures: at each `note` for commands with checkpoints, else at
//!   most every 30 seconds once the command has run two seconds.
//! - never: nothing.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `--progress`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// a live line on a terminal, plain lines otherwise
    #[default]
    Auto,
    /// the live line even when stderr is not a terminal
    Always,
    /// no progress output
    Never,
}

/// What a bar counts, and so how its count and speed read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unit {
    /// chunks of `tokens` tokens each: the speed is in tokens per second
    Chunks { tokens: u64 },
    /// trace rows
    Rows,
    Bytes,
    Documents,
}

/// Whether the live line is on the screen now. Read by the signal handler, which may only
/// touch atomics.
pub static LINE_SHOWN: AtomicBool = AtomicBool::new(false);

const DELAY: Duration = Duration::from_secs(2);
const TICK: Duration = Duration::from_millis(250);
const PLAIN_EVERY: Duration = Duration::from_secs(30);

static MODE: AtomicU8 = AtomicU8::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);
static GENERATION: AtomicU64 = AtomicU64::new(0);
static BAR: Mutex<Option<State>> = Mutex::new(None);
/// wakes the ticker when its bar ends
static WAKE: Condvar = Condvar::new();

pub fn configure(mode: Mode) {
    MODE.store(mode as u8, Ordering::Relaxed);
}

fn mode() -> Mode {
    match MODE.load(Ordering::Relaxed) {
        1 => Mode::Always,
        2 => Mode::Never,
        _ => Mode::Auto,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Style {
    Live,
    Plain,
    Off,
}

struct State {
    generation: u64,
    style: Style,
    total: u64,
    unit: Unit,
    label: String,
    detail: String,
    started: Instant,
    /// before this much time has passed nothing is drawn
    delay: Duration,
    checkpoints: bool,
    /// the last checkpoint: units it holds, when it was written
    checkpoint: Option<(u64, Instant)>,
    last_plain: Instant,
    /// what the live line shows now (not redrawn when unchanged)
    drawn: String,
    ever_shown: bool,
    /// someone else's text left the cursor inside a line: no drawing until it ends
    partial: bool,
}

/// A running progress bar. Dropping it without `finish` abandons it.
pub struct Bar {
    generation: u64,
    ticker: Option<JoinHandle<()>>,
}

fn lock() -> MutexGuard<'static, Option<State>> {
    BAR.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
static SINK: Mutex<Option<Vec<u8>>> = Mutex::new(None);

fn write_err(bytes: &[u8]) {
    #[cfg(test)]
    if let Some(buf) = SINK.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        buf.extend_from_slice(bytes);
        return;
    }
    let mut e = std::io::stderr().lock();
    let _ = e.write_all(bytes);
    let _ = e.flush();
}

/// Starts the process's bar (a bar still running is ended first).
pub fn start(total: u64, unit: Unit) -> Bar {
    let style = match mode() {
        Mode::Never => Style::Off,
        Mode::Always => Style::Live,
        Mode::Auto if std::io::stderr().is_terminal() => Style::Live,
        Mode::Auto => Style::Plain,
    };
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
    let mut g = lock();
    if let Some(old) = g.take() {
        end_line(&old, Some("stopped"));
    }
    DONE.store(0, Ordering::Relaxed);
    let now = Instant::now();
    *g = Some(State {
        generation,
        style,
        total,
        unit,
        label: String::new(),
        detail: String::new(),
        started: now,
        delay: std::env::var("REAP_PROGRESS_DELAY_MS").ok().and_then(|v| v.parse().ok()).map_or(DELAY, Duration::from_millis),
        checkpoints: false,
        checkpoint: None,
        last_plain: now,
        drawn: String::new(),
        ever_shown: false,
        partial: false,
    });
    drop(g);
    let ticker = (style != Style::Off).then(|| {
        std::thread::Builder::new().name("reap-progress".into()).spawn(move || tick_loop(generation)).expect("spawning the progress thread")
    });
    Bar { generation, ticker }
}

impl Bar {
    fn with(&self, f: impl FnOnce(&mut State)) {
        if let Some(s) = lock().as_mut().filter(|s| s.generation == self.generation) {
            f(s);
        }
    }

    /// The command writes checkpoints and calls `note` for each.
    pub fn checkpoints(self) -> Self {
        self.with(|s| s.checkpoints = true);
        self
    }

    /// Text before the count ("model 2/3").
    pub fn label(self, label: &str) -> Self {
        self.with(|s| s.label = label.to_string());
        self
    }

    /// The command shows its own progress on stdout; when that is the same terminal, a live
    /// line would draw over it.
    pub fn quiet_on_terminal(self) -> Self {
        if mode() == Mode::Auto && std::io::stdout().is_terminal() {
            self.with(|s| {
                if s.style == Style::Live {
                    s.style = Style::Off;
                }
            });
        }
        self
    }

    /// A figure of the command's own, shown last ("1.2 M tokens").
    pub fn detail(&self, text: &str) {
        self.with(|s| s.detail = text.to_string());
    }

    pub fn set(&self, done: u64) {
        set(done);
    }

    /// Success: the live line, if shown, is left with its final figures.
    pub fn finish(mut self) {
        self.end(None);
    }

    /// An error or a signal: the live line, if shown, is left with its figures and `why`.
    pub fn abandon(mut self, why: &str) {
        self.end(Some(why));
    }

    fn end(&mut self, why: Option<&str>) {
        let mut g = lock();
        if let Some(s) = g.take_if(|s| s.generation == self.generation) {
            end_line(&s, why);
        }
        drop(g);
        WAKE.notify_all();
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if self.ticker.is_some() || lock().as_ref().is_some_and(|s| s.generation == self.generation) {
            self.end(Some("stopped"));
        }
    }
}

/// Units done so far.
pub fn set(done: u64) {
    DONE.store(done, Ordering::Relaxed);
}

/// `n` more units done.
pub fn add(n: u64) {
    DONE.fetch_add(n, Ordering::Relaxed);
}

/// A checkpoint holding the first `at` units was written (so at least `at` are done).
pub fn note(at: u64) {
    DONE.fetch_max(at, Ordering::Relaxed);
    let mut g = lock();
    let Some(s) = g.as_mut() else { return };
    let now = Instant::now();
    s.checkpoint = Some((at, now));
    match s.style {
        Style::Plain => {
            s.last_plain = now;
            write_err(format!("progress: {}\n", s.line(now)).as_bytes());
        }
        Style::Live if LINE_SHOWN.load(Ordering::Relaxed) => s.draw(now),
        _ => {}
    }
}

/// Raw text to stderr (a log message, maybe without its newline), around the live line.
pub fn eprint(text: &str) {
    let mut g = lock();
    let Some(s) = g.as_mut().filter(|s| s.style == Style::Live) else {
        write_err(text.as_bytes());
        return;
    };
    s.clear();
    write_err(text.as_bytes());
    s.partial = !text.ends_with('\n');
    let now = Instant::now();
    if !s.partial && now - s.started >= s.delay {
        s.draw(now);
    }
}

/// A whole line to stderr, around the live line.
pub fn eprintln(line: &str) {
    eprint(&format!("{line}\n"));
}

fn tick_loop(generation: u64) {
    let mut g = lock();
    loop {
        g = WAKE.wait_timeout(g, TICK).unwrap_or_else(|e| e.into_inner()).0;
        let Some(s) = g.as_mut().filter(|s| s.generation == generation) else { return };
        let now = Instant::now();
        if now - s.started < s.delay {
            continue;
        }
        match s.style {
            Style::Live if !s.partial => s.draw(now),
            Style::Plain if !s.checkpoints && now - s.last_plain >= PLAIN_EVERY => {
                s.last_plain = now;
                write_err(format!("progress: {}\n", s.line(now)).as_bytes());
            }
            _ => {}
        }
    }
}

/// Leaves the screen clean when a bar ends: its final figures on a line of their own.
/// A run that outlasted the delay gets that line even if it ended before the first redraw.
fn end_line(s: &State, why: Option<&str>) {
    let now = Instant::now();
    let due = now - s.started >= s.delay;
    if s.style != Style::Live || !(s.ever_shown || LINE_SHOWN.load(Ordering::Relaxed) || due) {
        return;
    }
    let mut text = s.line(now);
    if let Some(w) = why {
        text = format!("{text}, {w}");
    }
    let lead = if s.partial { "\n" } else { "\r" };
    write_err(format!("{lead}{}\x1b[K\n", fit(&text, width())).as_bytes());
    LINE_SHOWN.store(false, Ordering::Relaxed);
}

impl State {
    fn line(&self, now: Instant) -> String {
        let done = DONE.load(Ordering::Relaxed);
        let v = View {
            label: &self.label,
            unit: self.unit,
            done: if self.total > 0 { done.min(self.total) } else { done },
            total: self.total,
            elapsed: now - self.started,
            checkpoint: if self.checkpoints { Some(self.checkpoint.map(|(at, t)| (at, now - t))) } else { None },
            detail: &self.detail,
        };
        v.compose()
    }

    fn draw(&mut self, now: Instant) {
        let text = fit(&self.line(now), width());
        if LINE_SHOWN.load(Ordering::Relaxed) && text == self.drawn {
            return;
        }
        write_err(format!("\r{text}\x1b[K").as_bytes());
        self.drawn = text;
        self.ever_shown = true;
        LINE_SHOWN.store(true, Ordering::Relaxed);
    }

    fn clear(&mut self) {
        if LINE_SHOWN.swap(false, Ordering::Relaxed) {
            write_err(b"\r\x1b[K");
        }
    }
}

/// The terminal's width on stderr (None when it is not a terminal).
fn width() -> Option<usize> {
    let mut ws = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ fills a winsize; a failure leaves it zeroed.
    let r = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0).then_some(ws.ws_col as usize)
}

/// Cuts `text` to one character less than the width: a line that wraps cannot be redrawn.
fn fit(text: &str, width: Option<usize>) -> String {
    match width {
        Some(w) if text.chars().count() >= w => text.chars().take(w.saturating_sub(1)).collect(),
        _ => text.to_string(),
    }
}

/// The figures of one line, as plain data (composed the same way live and plain).
struct View<'a> {
    label: &'a str,
    unit: Unit,
    done: u64,
    total: u64,
    elapsed: Duration,
    /// Some when the command writes checkpoints: the last one's units and age
    checkpoint: Option<Option<(u64, Duration)>>,
    detail: &'a str,
}

impl View<'_> {
    /// `12/64 chunks, 1843 tok/s, elapsed 3m12s, ETA 13m50s, checkpoint at 10 written 41s ago`
    fn compose(&self) -> String {
        let mut parts = Vec::new();
        let count = self.unit.count(self.done, self.total);
        parts.push(if self.label.is_empty() { count } else { format!("{}: {count}", self.label) });
        let secs = self.elapsed.as_secs_f64();
        parts.push(self.unit.speed(if secs > 0.0 { self.done as f64 / secs } else { 0.0 }));
        parts.push(format!("elapsed {}", clock(self.elapsed)));
        if self.total > 0 {
            parts.push(if self.done >= self.total {
                "ETA 0s".to_string()
            } else if self.done == 0 {
                "ETA ?".to_string()
            } else {
                // rounded up: work is left
                let left = self.elapsed.as_secs_f64() * (self.total - self.done) as f64 / self.done as f64;
                format!("ETA {}", clock(Duration::from_secs_f64(left.ceil())))
            });
        }
        match self.checkpoint {
            None => {}
            Some(None) => parts.push("no checkpoint yet".into()),
            Some(Some((at, age))) if age < Duration::from_secs(1) => parts.push(format!("checkpoint at {at} written now")),
            Some(Some((at, age))) => parts.push(format!("checkpoint at {at} written {} ago", clock(age))),
        }
        if !self.detail.is_empty() {
            parts.push(self.detail.to_string());
        }
        parts.join(", ")
    }
}

impl Unit {
    fn count(self, done: u64, total: u64) -> String {
        let name = match self {
            Unit::Chunks { .. } => "chunks",
            Unit::Rows => "rows",
            Unit::Documents => "documents",
            Unit::Bytes => {
                let (div, name) = if total.max(done) >= 1 << 30 { ((1u64 << 30) as f64, "GiB") } else { ((1u64 << 20) as f64, "MiB") };
                return if total > 0 {
                    format!("{:.2}/{:.2} {name}", done as f64 / div, total as f64 / div)
                } else {
                    format!("{:.2} {name}", done as f64 / div)
                };
            }
        };
        if total > 0 {
            format!("{done}/{total} {name}")
        } else {
            format!("{done} {name}")
        }
    }

    /// `per_sec`: units per second.
    fn speed(self, per_sec: f64) -> String {
        match self {
            Unit::Chunks { tokens } => format!("{:.0} tok/s", per_sec * tokens as f64),
            Unit::Rows => format!("{} rows/s", si(per_sec)),
            Unit::Documents => format!("{:.1} documents/s", per_sec),
            Unit::Bytes => format!("{:.1} MiB/s", per_sec / (1u64 << 20) as f64),
        }
    }
}

/// 950 → "950", 12_300 → "12.3 k", 4_560_000 → "4.56 M".
fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e4 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// 42 s → "42s", 192 s → "3m12s", 7380 s → "2h03m".
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(unit: Unit, done: u64, total: u64, elapsed: u64) -> View<'static> {
        View { label: "", unit, done, total, elapsed: Duration::from_secs(elapsed), checkpoint: None, detail: "" }
    }

    #[test]
    fn calibration_line_has_every_figure() {
        // 12 of 64 chunks of 512 tokens in 192 s: 32 tok/s; 52 chunks left at 16 s each
        let mut v = view(Unit::Chunks { tokens: 512 }, 12, 64, 192);
        v.checkpoint = Some(Some((10, Duration::from_secs(41))));
        assert_eq!(v.compose(), "12/64 chunks, 32 tok/s, elapsed 3m12s, ETA 13m52s, checkpoint at 10 written 41s ago");
        v.checkpoint = Some(None);
        v.done = 0;
        assert_eq!(v.compose(), "0/64 chunks, 0 tok/s, elapsed 3m12s, ETA ?, no checkpoint yet");
        v.checkpoint = Some(Some((64, Duration::from_millis(300))));
        v.done = 64;
        assert!(v.compose().ends_with("ETA 0s, checkpoint at 64 written now"), "{}", v.compose());
    }

    #[test]
    fn other_units() {
        assert_eq!(view(Unit::Rows, 30_000, 120_000, 2).compose(), "30000/120000 rows, 15.0 k rows/s, elapsed 2s, ETA 6s");
        assert_eq!(view(Unit::Bytes, 3 << 29, 4 << 30, 3).compose(), "1.50/4.00 GiB, 512.0 MiB/s, elapsed 3s, ETA 5s");
        let mut v = view(Unit::Documents, 50, 0, 10);
        v.label = "source web";
        v.detail = "1.2 M tokens";
        assert_eq!(v.compose(), "source web: 50 documents, 5.0 documents/s, elapsed 10s, 1.2 M tokens");
    }

    /// The bar's protocol on the wire, through a sink instead of stderr. One test, since the
    /// bar is process-wide (replay's unit tests may add to the counter meanwhile: no exact
    /// counts are asserted).
    #[test]
    fn live_line_steps_around_other_output_and_plain_lines_have_no_control_characters() {
        let take = || String::from_utf8(SINK.lock().unwrap().replace(Vec::new()).unwrap()).unwrap();
        *SINK.lock().unwrap() = Some(Vec::new());
        configure(Mode::Always);
        let bar = start(10, Unit::Rows);
        bar.with(|s| s.delay = Duration::ZERO);
        bar.set(3);
        eprint("first\n");
        eprint("llama log line\n");
        eprint("partial ");
        // the ticker must not draw into someone else's unfinished line
        std::thread::sleep(TICK * 3);
        eprint("rest\n");
        bar.set(10);
        bar.finish();
        let out = take();
        // erased before the log line, drawn again after it
        let (_, after) = out.split_once("\r\x1b[Kllama log line\n\r").unwrap_or_else(|| panic!("{out:?}"));
        assert!(after.split("\x1b[K").next().unwrap().contains("/10 rows, "), "{out:?}");
        assert!(out.contains("partial rest\n"), "{out:?}");
        // ends with its final figures on a line of their own
        assert!(out.ends_with("\x1b[K\n"), "{out:?}");
        let last = out.trim_end_matches("\x1b[K\n").rsplit('\r').next().unwrap();
        assert!(last.starts_with("10/10 rows, ") && last.contains("ETA 0s") && !last.contains("stopped"), "{last:?}");

        // abandoned (an error, a signal): says why
        let bar = start(10, Unit::Rows);
        bar.with(|s| s.delay = Duration::ZERO);
        eprint("x\n");
        drop(bar);
        assert!(take().ends_with(", stopped\x1b[K\n"));

        // plain: one whole line per checkpoint, nothing else, no control characters
        configure(Mode::Auto);
        let bar = start(10, Unit::Chunks { tokens: 4 }).checkpoints();
        bar.with(|s| s.style = Style::Plain);
        note(4);
        eprint("a message\n");
        bar.finish();
        let out = take();
        *SINK.lock().unwrap() = None;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out:?}");
        assert!(lines[0].starts_with("progress: ") && lines[0].contains("/10 chunks, ") && lines[0].ends_with(", checkpoint at 4 written now"), "{out:?}");
        assert_eq!(lines[1], "a message");
        assert!(!out.contains(['\r', '\x1b']), "{out:?}");
    }

    #[test]
    fn clocks_and_widths() {
        assert_eq!(clock(Duration::from_secs(7380)), "2h03m");
        assert_eq!(clock(Duration::from_secs(59)), "59s");
        assert_eq!(fit("abcdef", Some(4)), "abc");
        assert_eq!(fit("abc", Some(4)), "abc");
        assert_eq!(fit("abcdef", None), "abcdef");
        assert_eq!(si(4_560_000.0), "4.56 M");
    }
}
