//! A `--rpc` server that stops answering without closing its connection (the process stopped
//! or hung, the network to it cut) leaves ggml-rpc blocked in recv() for ever: no error reaches
//! ggml's abort path, so upstream's tools and a plain run wait with no word. This watchdog looks
//! once a second at what each thread of the process is blocked in (`/proc/self/task/*/syscall`).
//! A thread blocked reading from or writing to an `--rpc` server's socket while that socket
//! moves no bytes (TCP_INFO: bytes acked plus bytes received) for `--rpc-timeout` seconds ends
//! the run as a lost server does: the server named, the last checkpoint intact, exit 1.
//!
//! Waiting in recv() is also what a healthy server's long graph looks like (ggml-rpc's
//! dispatcher waits there while the server computes), so the default is generous: one graph
//! split computing for ten minutes on one server is far beyond any ubatch we have seen.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `--rpc-timeout` when not given, in seconds.
pub const DEFAULT_TIMEOUT_S: u64 = 600;

static TIMEOUT_S: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT_S);

/// `--rpc-timeout SECONDS`; 0 waits for ever (upstream's behaviour).
pub fn set_timeout(secs: u64) {
    TIMEOUT_S.store(secs, Ordering::SeqCst);
}

/// Starts the watchdog thread once per process (when the first `--rpc` server is added).
pub(super) fn start() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        if !supported() {
            return;
        }
        let _ = std::thread::Builder::new().name("rpc-watch".into()).spawn(watch);
    });
}

fn watch() {
    let mut watch = Watch::default();
    let mut resolved: HashMap<String, Vec<SocketAddr>> = HashMap::new();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let timeout = TIMEOUT_S.load(Ordering::SeqCst);
        if timeout == 0 {
            continue;
        }
        let servers: Vec<(String, Vec<SocketAddr>)> = super::abort::rpc_servers()
            .into_iter()
            .map(|s| {
                let addrs = resolved.entry(s.clone()).or_insert_with(|| s.to_socket_addrs().map(|a| a.collect()).unwrap_or_default());
                (s, addrs.clone())
            })
            .collect();
        if let Some(stall) = watch.sample(Instant::now(), &servers, Duration::from_secs(timeout)) {
            super::abort::stop_for_silent_server(&stall.endpoint, stall.waited, timeout);
        }
    }
}

/// A server that moved no bytes while a thread waited on it.
#[derive(Debug)]
pub(crate) struct Stall {
    pub endpoint: String,
    pub waited: Duration,
}

/// One socket some thread is blocked on: its peer, its byte count, since when both held.
struct Streak {
    peer: SocketAddr,
    bytes: u64,
    since: Instant,
}

#[derive(Default)]
pub(crate) struct Watch {
    streaks: HashMap<i32, Streak>,
}

impl Watch {
    /// One look: the server whose socket a thread has been blocked on, with no byte moved, for
    /// `timeout` or longer. A socket not blocked on at this look starts afresh at the next.
    pub(crate) fn sample(&mut self, now: Instant, servers: &[(String, Vec<SocketAddr>)], timeout: Duration) -> Option<Stall> {
        let mut kept = HashMap::new();
        let mut found = None;
        for fd in blocked_fds() {
            let Some(peer) = peer_of(fd) else { continue };
            let Some((endpoint, _)) = servers.iter().find(|(_, addrs)| addrs.contains(&peer)) else { continue };
            let Some(bytes) = tcp_bytes(fd) else { continue };
            let streak = match self.streaks.remove(&fd) {
                Some(s) if s.peer == peer && s.bytes == bytes => s,
                _ => Streak { peer, bytes, since: now },
            };
            let waited = now.saturating_duration_since(streak.since);
            if waited >= timeout && found.is_none() {
                found = Some(Stall { endpoint: endpoint.clone(), waited });
            }
            kept.insert(fd, streak);
        }
        self.streaks = kept;
        found
    }
}

/// The blocking socket calls (read, write, sendto, recvfrom, sendmsg, recvmsg): the first
/// argument of each is the file descriptor.
#[cfg(target_arch = "x86_64")]
const IO_SYSCALLS: &[i64] = &[0, 1, 44, 45, 46, 47];
#[cfg(target_arch = "aarch64")]
const IO_SYSCALLS: &[i64] = &[63, 64, 206, 207, 211, 212];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const IO_SYSCALLS: &[i64] = &[];

fn supported() -> bool {
    !IO_SYSCALLS.is_empty() && std::path::Path::new("/proc/self/task").is_dir()
}

/// The descriptors this process's threads are blocked on in a read or write call now.
fn blocked_fds() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    let mut fds = Vec::new();
    for task in dir.flatten() {
        let Ok(line) = std::fs::read_to_string(task.path().join("syscall")) else { continue };
        if let Some(fd) = io_fd(&line) {
            if !fds.contains(&fd) {
                fds.push(fd);
            }
        }
    }
    fds
}

/// The file descriptor of a `/proc/…/syscall` line ("NR ARG1 … SP PC") when the call is one of
/// the blocking reads and writes; "running" and "-1 …" (not in a call) give None.
pub(crate) fn io_fd(line: &str) -> Option<i32> {
    let mut words = line.split_whitespace();
    let nr: i64 = words.next()?.parse().ok()?;
    if !IO_SYSCALLS.contains(&nr) {
        return None;
    }
    let arg = words.next()?;
    let fd = i64::from_str_radix(arg.strip_prefix("0x")?, 16).ok()?;
    i32::try_from(fd).ok().filter(|fd| *fd >= 0)
}

/// The TCP peer of a descriptor (None when it is not a connected IP socket).
fn peer_of(fd: i32) -> Option<SocketAddr> {
    // SAFETY: getpeername(2) into a zeroed sockaddr_storage of the size we pass.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    if unsafe { libc::getpeername(fd, &mut ss as *mut _ as *mut libc::sockaddr, &mut len) } != 0 {
        return None;
    }
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a: libc::sockaddr_in = unsafe { std::ptr::read(&ss as *const _ as *const libc::sockaddr_in) };
            Some(SocketAddr::from((u32::from_be(a.sin_addr.s_addr).to_be_bytes(), u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a: libc::sockaddr_in6 = unsafe { std::ptr::read(&ss as *const _ as *const libc::sockaddr_in6) };
            Some(SocketAddr::from((a.sin6_addr.s6_addr, u16::from_be(a.sin6_port))))
        }
        _ => None,
    }
}

/// Bytes the peer acknowledged plus bytes received on a TCP socket: what moves while a server
/// answers (None on kernels older than 4.2, which lack the counters: no watching there).
fn tcp_bytes(fd: i32) -> Option<u64> {
    // SAFETY: getsockopt(2) into a zeroed tcp_info of the size we pass; the kernel says how much
    // it filled.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    if unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut info as *mut _ as *mut libc::c_void, &mut len) } != 0 {
        return None;
    }
    let end = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_received) + std::mem::size_of::<u64>();
    (len as usize >= end).then(|| info.tcpi_bytes_acked.wrapping_add(info.tcpi_bytes_received))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_syscall_line_gives_the_descriptor_of_a_blocking_read_or_write_only() {
        if IO_SYSCALLS.is_empty() {
            return;
        }
        let read = IO_SYSCALLS[3]; // recvfrom
        assert_eq!(io_fd(&format!("{read} 0x7 0x7f12a0001000 0x8 0x0 0x0 0x0 0x7ffd1c 0x7f12b")), Some(7));
        assert_eq!(io_fd(&format!("{} 0x1f 0x0 0x0 0x0 0x0 0x0 0x7ffd 0x7f", IO_SYSCALLS[0])), Some(31));
        assert_eq!(io_fd("running"), None);
        assert_eq!(io_fd("-1 0x7ffd1c 0x7f12b"), None);
        assert_eq!(io_fd("202 0x7f12a0001000 0x80 0x0 0x0 0x0 0x0 0x7ffd 0x7f"), None, "futex is not a socket wait");
        assert_eq!(io_fd(""), None);
    }

    /// A thread blocked reading from a listed peer that sends nothing is a stall once the
    /// timeout has passed (not before); an unlisted peer is never one; bytes arriving start the
    /// wait afresh.
    #[test]
    fn a_silent_listed_peer_is_found_and_a_talking_one_is_not() {
        if !supported() {
            eprintln!("note: no /proc/self/task or unknown syscall numbers here: nothing to watch");
            return;
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let endpoint = addr.to_string();
        let client = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"request!").unwrap();
            let mut buf = [0u8; 1];
            let mut got = 0;
            while s.read(&mut buf).unwrap() == 1 {
                got += 1;
            }
            got
        });
        let (mut server, _) = listener.accept().unwrap();
        let mut req = [0u8; 8];
        server.read_exact(&mut req).unwrap();
        // the client is now (or shortly) blocked in its read
        let t0 = Instant::now();
        let listed = vec![(endpoint.clone(), vec![addr])];
        let timeout = Duration::from_secs(5);
        let mut w = Watch::default();
        let deadline = Instant::now() + Duration::from_secs(20);
        while w.streaks.is_empty() {
            assert!(Instant::now() < deadline, "the client's blocked read was never seen");
            assert!(w.sample(t0, &listed, timeout).is_none());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(w.sample(t0 + Duration::from_secs(4), &listed, timeout).is_none(), "stalled before the timeout");
        let stall = w.sample(t0 + Duration::from_secs(6), &listed, timeout).expect("a silent server is a stall");
        assert_eq!(stall.endpoint, endpoint);
        assert_eq!(stall.waited, Duration::from_secs(6));
        assert!(Watch::default().sample(t0, &[("elsewhere:1".into(), vec!["127.0.0.1:1".parse().unwrap()])], Duration::ZERO).is_none());
        // a byte arrives: the wait starts again from the look that sees it
        server.write_all(b"x").unwrap();
        let mut later = t0 + Duration::from_secs(7);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "the byte that arrived was never seen");
            w.sample(later, &listed, timeout);
            if w.streaks.values().any(|s| s.since == later) {
                break;
            }
            later += Duration::from_millis(1);
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(w.sample(later + Duration::from_secs(4), &listed, timeout).is_none(), "the answer did not reset the wait");
        drop(server);
        assert_eq!(client.join().unwrap(), 1);
    }
}
