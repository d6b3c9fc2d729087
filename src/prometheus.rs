//! Prometheus metrics: a pipeline's statistics in the text exposition format, and a small
//! HTTP endpoint (the standard library's sockets, one thread) that serves them on `GET
//! /metrics`. One renderer for every front end: `flowgate run`'s `[metrics] prometheus`
//! and the Python loaders' `metrics_port=`. Every series carries the labels given — the
//! rank's (`rank`, `local_rank`: [`rank_labels`]) so the ranks of a node scraped together stay
//! apart. The metric names are documented in the README.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::engine::stats::PipelineStats;

/// Where an endpoint serves, as every front end names it (a pipeline file's `[metrics]
/// prometheus`, Python's `metrics_port=`): a port alone on the loopback address (`"9100"` is
/// `127.0.0.1:9100`), or `HOST:PORT` with a host name or address (`"0.0.0.0:9100"` for a
/// scraper on another machine, `"[::1]:9100"`). Port 0 picks a free one. The endpoint has no
/// TLS or authentication: a host other than loopback should be a private network's.
pub fn address(given: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let bad = |why: &str| format!("{given:?} is not a port or HOST:PORT: {why}");
    let port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| bad("the port must be a number in 0..=65535"))
    };
    let (host, port) = match given.rsplit_once(':') {
        None => ("127.0.0.1", port(given)?),
        Some((host, p)) => (host.trim_start_matches('[').trim_end_matches(']'), port(p)?),
    };
    if host.is_empty() {
        return Err(bad("the host is empty"));
    }
    (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(&e.to_string()))?
        .next()
        .ok_or_else(|| bad("it resolves to no address"))
}

/// The rank's labels from torchrun's environment: `rank` (`RANK`) and `local_rank`
/// (`LOCAL_RANK`), `"0"` where unset.
pub fn rank_labels() -> Vec<(String, String)> {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "0".to_owned());
    vec![
        ("rank".to_owned(), var("RANK")),
        ("local_rank".to_owned(), var("LOCAL_RANK")),
    ]
}

/// `stats` in the text exposition format, every series with `labels`. Counters are totals
/// since the pipeline started (a rebuilt pipeline starts them again: a counter reset).
pub fn render(stats: &PipelineStats, labels: &[(String, String)]) -> String {
    let mut out = Metrics::new(labels);
    out.counter("flowgate_delivered_total", &[], stats.delivered as f64);
    out.counter("flowgate_failures_total", &[], stats.failures as f64);
    out.counter(
        "flowgate_consumer_wait_seconds_total",
        &[],
        stats.consumer_wait.as_secs_f64(),
    );
    out.gauge("flowgate_epoch", &[], stats.epoch as f64);
    if let Some(m) = &stats.memory_budget {
        out.gauge("flowgate_memory_budget_bytes", &[], m.bytes as f64);
    }
    let held = stats.bytes_held();
    out.gauge("flowgate_held_bytes", &[], held as f64);
    for s in &stats.stages {
        let stage = [("stage", s.name.as_str())];
        out.gauge("flowgate_stage_workers", &stage, s.workers as f64);
        out.counter("flowgate_stage_items_in_total", &stage, s.items_in as f64);
        out.counter("flowgate_stage_items_out_total", &stage, s.items_out as f64);
        out.counter("flowgate_stage_failures_total", &stage, s.failures as f64);
        out.gauge("flowgate_stage_queue_items", &stage, s.queue_items as f64);
        out.gauge("flowgate_stage_queue_bytes", &stage, s.queue_bytes as f64);
        out.gauge("flowgate_stage_budget_items", &stage, s.budget_items as f64);
        out.counter(
            "flowgate_stage_busy_seconds_total",
            &stage,
            s.busy.as_secs_f64(),
        );
        out.counter(
            "flowgate_stage_blocked_put_seconds_total",
            &stage,
            s.blocked_put.as_secs_f64(),
        );
        out.counter(
            "flowgate_stage_blocked_get_seconds_total",
            &stage,
            s.blocked_get.as_secs_f64(),
        );
        out.gauge(
            "flowgate_stage_task_p50_seconds",
            &stage,
            s.task_time.p50.as_secs_f64(),
        );
        out.gauge(
            "flowgate_stage_task_p99_seconds",
            &stage,
            s.task_time.p99.as_secs_f64(),
        );
        if let Some(c) = &s.cache {
            out.gauge(
                "flowgate_cache_capacity_bytes",
                &stage,
                c.capacity_bytes as f64,
            );
            out.gauge("flowgate_cache_bytes", &stage, c.bytes as f64);
            out.counter("flowgate_cache_hits_total", &stage, c.hits as f64);
            out.counter("flowgate_cache_misses_total", &stage, c.misses as f64);
            out.counter(
                "flowgate_cache_evicted_bytes_total",
                &stage,
                c.evicted_bytes as f64,
            );
        }
    }
    out.finish()
}

/// Series grouped by metric name (the format wants each name's `# TYPE` once, its series
/// together), in the order first seen.
struct Metrics<'a> {
    labels: &'a [(String, String)],
    families: Vec<(&'static str, &'static str, String)>,
}

impl<'a> Metrics<'a> {
    fn new(labels: &'a [(String, String)]) -> Self {
        Self {
            labels,
            families: Vec::new(),
        }
    }

    fn counter(&mut self, name: &'static str, extra: &[(&str, &str)], value: f64) {
        self.series(name, "counter", extra, value);
    }

    fn gauge(&mut self, name: &'static str, extra: &[(&str, &str)], value: f64) {
        self.series(name, "gauge", extra, value);
    }

    fn series(&mut self, name: &'static str, kind: &'static str, extra: &[(&str, &str)], v: f64) {
        let i = match self.families.iter().position(|(n, _, _)| *n == name) {
            Some(i) => i,
            None => {
                self.families.push((name, kind, String::new()));
                self.families.len() - 1
            }
        };
        let body = &mut self.families[i].2;
        body.push_str(name);
        let pairs = self
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(extra.iter().copied());
        for (k, (key, value)) in pairs.enumerate() {
            body.push(if k == 0 { '{' } else { ',' });
            let _ = write!(body, "{key}=\"{}\"", escape(value));
        }
        if !self.labels.is_empty() || !extra.is_empty() {
            body.push('}');
        }
        let _ = writeln!(body, " {v}");
    }

    fn finish(self) -> String {
        let mut out = String::new();
        for (name, kind, body) in self.families {
            let _ = writeln!(out, "# TYPE {name} {kind}");
            out.push_str(&body);
        }
        out
    }
}

/// A label value escaped as the format says (backslash, double quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Requests answered at once; a connection beyond them is closed unanswered.
const CONCURRENT: usize = 8;
/// How long a request may take to arrive and its answer to leave.
const REQUEST_TIME: Duration = Duration::from_secs(2);

/// An HTTP endpoint that answers `GET /metrics` with what `render` returns at that moment
/// (other paths: 404). One thread accepts and hands each connection to a short-lived
/// thread of its own (at most [`CONCURRENT`]), so a slow or idle client delays neither
/// other scrapes nor the endpoint's end: dropping it frees the port at once.
pub struct Endpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The listening socket's descriptor, for a forked child to close (see
    /// [`forget_in_fork`](Self::forget_in_fork)).
    #[cfg(unix)]
    fd: std::os::fd::RawFd,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Listens on `addr` (port 0: one the system picks; see [`addr`](Self::addr)). An
    /// address in use is an error naming it.
    pub fn serve(
        addr: SocketAddr,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            std::io::Error::new(e.kind(), format!("serving metrics on {addr}: {e}"))
        })?;
        let addr = listener.local_addr()?;
        #[cfg(unix)]
        let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let render = Arc::new(render);
        let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let thread = std::thread::Builder::new()
            .name("flowgate-metrics".to_owned())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopping.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(stream) = conn else { continue };
                    if busy.fetch_add(1, Ordering::AcqRel) >= CONCURRENT {
                        busy.fetch_sub(1, Ordering::AcqRel);
                        continue; // dropped: closed unanswered
                    }
                    let (render, done) = (Arc::clone(&render), Arc::clone(&busy));
                    let spawned = std::thread::Builder::new()
                        .name("flowgate-metrics-request".to_owned())
                        .spawn(move || {
                            let _ = answer(stream, &*render);
                            done.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        busy.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
            #[cfg(unix)]
            fd,
        })
    }

    /// The address served (with the port the system picked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// In a process forked from the one serving: closes this process's copy of the listening
    /// socket (so the port is the parent's alone, and freed when the parent stops) and
    /// forgets the rest — the accepting thread is the parent's, and does not exist here.
    pub fn forget_in_fork(self) {
        #[cfg(unix)]
        {
            use std::os::fd::FromRawFd;
            // SAFETY: the descriptor is the listener's, which nothing in this process uses
            // (its thread was not forked) and nothing else closes (the endpoint is forgotten).
            drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(self.fd) });
        }
        std::mem::forget(self);
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accepting thread, which sees `stop` and returns, closing the listener.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request: its head read (up to 8 KiB, within [`REQUEST_TIME`]), then the metrics or
/// a 404, and the connection closed.
fn answer(mut stream: TcpStream, render: &dyn Fn() -> String) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + REQUEST_TIME;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(()); // too slow: closed unanswered
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    stream.set_write_timeout(Some(REQUEST_TIME))?;
    let line = String::from_utf8_lossy(&head);
    let path = line.split_whitespace().nth(1).unwrap_or("");
    let (status, body, kind) = if path == "/metrics" || path.starts_with("/metrics?") {
        ("200 OK", render(), "text/plain; version=0.0.4")
    } else {
        ("404 Not Found", "try /metrics\n".to_owned(), "text/plain")
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_a_port_on_loopback_or_a_host_and_port() {
        let ok = |s: &str| address(s).unwrap().to_string();
        assert_eq!(ok("9100"), "127.0.0.1:9100");
        assert_eq!(ok("0"), "127.0.0.1:0");
        assert_eq!(ok("0.0.0.0:9100"), "0.0.0.0:9100");
        assert_eq!(ok("[::1]:9100"), "[::1]:9100");
        assert_eq!(ok("localhost:65535").rsplit_once(':').unwrap().1, "65535");
        for (s, says) in [
            ("65536", "the port must be a number in 0..=65535"),
            ("-1", "the port must be a number in 0..=65535"),
            ("host:", "the port must be a number"),
            (":9100", "the host is empty"),
            (
                "no such host.invalid:9100",
                "\"no such host.invalid:9100\" is not a port",
            ),
        ] {
            let e = address(s).unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn series_carry_the_labels_and_each_family_its_type_once() {
        let mut stats = PipelineStats {
            delivered: 7,
            ..Default::default()
        };
        for name in ["decode", "sink"] {
            stats.stages.push(flowgate_tuner::StageStats {
                name: name.to_owned(),
                workers: 3,
                ..Default::default()
            });
        }
        let labels = vec![
            ("rank".to_owned(), "2".to_owned()),
            ("job".to_owned(), "a\"b".to_owned()),
        ];
        let text = render(&stats, &labels);
        assert!(
            text.contains("flowgate_delivered_total{rank=\"2\",job=\"a\\\"b\"} 7\n"),
            "{text}"
        );
        assert!(
            text.contains("flowgate_stage_workers{rank=\"2\",job=\"a\\\"b\",stage=\"decode\"} 3\n"),
            "{text}"
        );
        assert_eq!(
            text.matches("# TYPE flowgate_stage_workers gauge").count(),
            1
        );
        // A family's series follow its TYPE line.
        let at = text.find("# TYPE flowgate_stage_workers").unwrap();
        let next: Vec<&str> = text[at..].lines().skip(1).take(2).collect();
        assert!(
            next.iter()
                .all(|l| l.starts_with("flowgate_stage_workers{")),
            "{next:?}"
        );
        let bare = render(&stats, &[]);
        assert!(bare.contains("\nflowgate_delivered_total 7\n"), "{bare}");
    }

    #[test]
    fn the_endpoint_serves_what_render_returns_now_and_stops_when_dropped() {
        let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = Arc::clone(&n);
        let e = Endpoint::serve("127.0.0.1:0".parse().unwrap(), move || {
            format!("calls {}\n", seen.fetch_add(1, Ordering::Relaxed))
        })
        .unwrap();
        let addr = e.addr();
        assert!(get(addr, "/metrics").ends_with("calls 0\n"));
        assert!(get(addr, "/metrics").ends_with("calls 1\n"));
        assert!(get(addr, "/").starts_with("HTTP/1.1 404"));
        // Clients that connect and send nothing delay neither a scrape nor the end.
        let idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let t = std::time::Instant::now();
        assert!(get(addr, "/metrics").ends_with("calls 2\n"));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // The port is taken while it serves: a second endpoint on it is an error naming it.
        let err = Endpoint::serve(addr, String::new).unwrap_err();
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        let t = std::time::Instant::now();
        drop(e);
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "dropped in {:?}",
            t.elapsed()
        );
        assert!(TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_err());
        drop(idle);
    }
}
