//! What the S3 tests share: a real S3-compatible server per test (s3s-fs on 127.0.0.1) with a
//! client and a bucket, and a fault-injecting proxy in front of it.
#![allow(dead_code)] // each test file uses its own part

use std::path::PathBuf;
use std::time::Duration;

use flowgate::s3::{LocalServer, S3};

pub(crate) struct Fixture {
    pub(crate) server: LocalServer,
    pub(crate) s3: S3,
    pub(crate) _dir: TempDir,
}

pub(crate) struct TempDir(pub(crate) PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn fixture(name: &str) -> Fixture {
    // Numbered: the tests of several files share this process (and may share a name).
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("flowgate-s3-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = LocalServer::start(&dir).expect("start s3s-fs (run scripts/setup.sh --test)");
    let mut cfg = server.config("data");
    cfg.list_page_size = Some(7); // exercise pagination with a small bucket
    let s3 = S3::connect(cfg).unwrap();
    futures::executor::block_on(s3.create_bucket()).unwrap();
    Fixture {
        server,
        s3,
        _dir: TempDir(dir),
    }
}

pub(crate) fn jpeg(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([x as u8 ^ seed, y as u8, seed.wrapping_mul(3)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

pub(crate) fn put(s3: &S3, key: &str, bytes: Vec<u8>) {
    futures::executor::block_on(s3.put(key, bytes)).unwrap();
}

/// A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of the real server. Each request
/// gets its own upstream connection and `Connection: close`; by the request's number it is
/// forwarded, answered with a 500 or a 503 SlowDown, reset (RST), stalled past the client's
/// attempt timeout, or forwarded with its body cut in half. Keys containing `poison` always
/// get a 500.
pub(crate) mod fault_proxy {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    #[derive(Debug, Default)]
    pub(crate) struct Counts {
        pub(crate) requests: AtomicU64,
        pub(crate) forwarded: AtomicU64,
        pub(crate) internal_error: AtomicU64,
        pub(crate) slow_down: AtomicU64,
        pub(crate) reset: AtomicU64,
        pub(crate) stalled: AtomicU64,
        pub(crate) truncated: AtomicU64,
        /// GET requests with a `Range` header.
        pub(crate) ranged: AtomicU64,
        /// Of those, the ones that carry `If-Match` (pinned to the version being read).
        pub(crate) ranged_if_match: AtomicU64,
        /// GETs answered 412 Precondition Failed: their `If-Match` named another version
        /// than the store's (the local server ignores `If-Match`; the proxy checks it as S3
        /// does).
        pub(crate) precondition_failed: AtomicU64,
        /// Milliseconds every GET of a `.tar` waits before it is forwarded (a slow link).
        pub(crate) tar_latency_ms: AtomicU64,
        /// GET requests per path (`/bucket/key`, no query).
        pub(crate) gets: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    }

    impl Counts {
        /// GETs of paths ending in `suffix`, per path.
        pub(crate) fn gets_of(&self, suffix: &str) -> std::collections::HashMap<String, u64> {
            let g = self.gets.lock().unwrap();
            g.iter()
                .filter(|(k, _)| k.ends_with(suffix))
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Fault {
        None,
        Status(u16, &'static str),
        Reset,
        Stall,
        Truncate,
    }

    pub(crate) struct FaultProxy {
        pub(crate) addr: SocketAddr,
        pub(crate) counts: Arc<Counts>,
        rt: Option<tokio::runtime::Runtime>,
    }

    impl Drop for FaultProxy {
        fn drop(&mut self) {
            if let Some(rt) = self.rt.take() {
                rt.shutdown_background();
            }
        }
    }

    impl FaultProxy {
        pub(crate) fn start(upstream: SocketAddr, stall: Duration) -> Self {
            Self::start_with(upstream, Some(stall))
        }

        /// A proxy that forwards everything (and counts), without faults.
        pub(crate) fn clean(upstream: SocketAddr) -> Self {
            Self::start_with(upstream, None)
        }

        fn start_with(upstream: SocketAddr, faults: Option<Duration>) -> Self {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let listener = rt
                .block_on(TcpListener::bind("127.0.0.1:0"))
                .expect("bind the proxy");
            let addr = listener.local_addr().unwrap();
            let counts = Arc::new(Counts::default());
            let c = Arc::clone(&counts);
            rt.spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let c = Arc::clone(&c);
                    tokio::spawn(async move {
                        let _ = handle(client, upstream, faults, &c).await;
                    });
                }
            });
            Self {
                addr,
                counts,
                rt: Some(rt),
            }
        }
    }

    /// 10% errors (500, SlowDown, reset, truncated body in turn) and 4% stalls.
    fn plan(n: u64, target: &str) -> Fault {
        if target.contains("poison") {
            return Fault::Status(500, "InternalError");
        }
        if n % 25 == 17 {
            return Fault::Stall;
        }
        if n % 10 == 3 {
            return match (n / 10) % 4 {
                0 => Fault::Status(500, "InternalError"),
                1 => Fault::Status(503, "SlowDown"),
                2 => Fault::Reset,
                _ => Fault::Truncate,
            };
        }
        Fault::None
    }

    /// The value of header `name` (lower case) in an HTTP head, trimmed.
    fn header(head: &str, name: &str) -> Option<String> {
        head.split("\r\n").find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    }

    fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
        hay.windows(needle.len()).position(|w| w == needle)
    }

    fn content_length(head: &str) -> usize {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }

    async fn handle(
        mut client: TcpStream,
        upstream: SocketAddr,
        faults: Option<Duration>,
        c: &Counts,
    ) -> std::io::Result<()> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let n = client.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let body_len = content_length(&head);
        while buf.len() < head_end + body_len {
            let n = client.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let target = head.split_whitespace().nth(1).unwrap_or("").to_owned();
        let n = c.requests.fetch_add(1, Ordering::Relaxed);
        if head.starts_with("GET ") {
            let path = target.split('?').next().unwrap_or("").to_owned();
            *c.gets.lock().unwrap().entry(path).or_insert(0) += 1;
            let lower = head.to_ascii_lowercase();
            if lower.contains("\r\nrange:") {
                c.ranged.fetch_add(1, Ordering::Relaxed);
                if lower.contains("\r\nif-match:") {
                    c.ranged_if_match.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let latency = c.tar_latency_ms.load(Ordering::Relaxed);
        if latency > 0 && head.starts_with("GET ") && target.contains(".tar") {
            tokio::time::sleep(Duration::from_millis(latency)).await;
        }
        let stall = faults.unwrap_or_default();
        let fault = match faults {
            Some(_) => plan(n, &target),
            None => Fault::None,
        };
        match fault {
            Fault::Status(status, code) => {
                let counter = if status == 503 {
                    &c.slow_down
                } else {
                    &c.internal_error
                };
                counter.fetch_add(1, Ordering::Relaxed);
                let body = format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>\
                     <Message>injected by the fault proxy</Message></Error>"
                );
                let reason = if status == 503 {
                    "Slow Down"
                } else {
                    "Internal Server Error"
                };
                let resp = format!(
                    "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                client.write_all(resp.as_bytes()).await?;
                client.shutdown().await
            }
            Fault::Reset => {
                c.reset.fetch_add(1, Ordering::Relaxed);
                client.set_zero_linger()?;
                drop(client);
                Ok(())
            }
            Fault::Stall => {
                c.stalled.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(stall).await;
                Ok(())
            }
            Fault::None | Fault::Truncate => {
                // One request per upstream connection, closed after the response.
                let mut req: Vec<u8> = Vec::new();
                for line in head[..head.len() - 2]
                    .split("\r\n")
                    .filter(|l| !l.is_empty())
                {
                    if !line.to_ascii_lowercase().starts_with("connection:") {
                        req.extend_from_slice(line.as_bytes());
                        req.extend_from_slice(b"\r\n");
                    }
                }
                req.extend_from_slice(b"Connection: close\r\n\r\n");
                req.extend_from_slice(&buf[head_end..head_end + body_len]);
                let mut up = TcpStream::connect(upstream).await?;
                up.write_all(&req).await?;
                let mut resp = Vec::new();
                up.read_to_end(&mut resp).await?;
                if let Some(wanted) = header(&head, "if-match") {
                    let resp_head = find(&resp, b"\r\n\r\n")
                        .map(|i| String::from_utf8_lossy(&resp[..i + 2]).into_owned())
                        .unwrap_or_default();
                    let ok = resp_head.starts_with("HTTP/1.1 2");
                    if ok && header(&resp_head, "etag").as_deref() != Some(wanted.as_str()) {
                        c.precondition_failed.fetch_add(1, Ordering::Relaxed);
                        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error>\
                                    <Code>PreconditionFailed</Code><Message>At least one of \
                                    the pre-conditions you specified did not hold</Message>\
                                    </Error>";
                        let resp = format!(
                            "HTTP/1.1 412 Precondition Failed\r\nContent-Type: application/xml\r\n\
                             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        client.write_all(resp.as_bytes()).await?;
                        return client.shutdown().await;
                    }
                }
                let cut = match (fault, find(&resp, b"\r\n\r\n")) {
                    (Fault::Truncate, Some(i)) if resp.len() > i + 4 + 1 => {
                        c.truncated.fetch_add(1, Ordering::Relaxed);
                        i + 4 + (resp.len() - i - 4) / 2
                    }
                    _ => {
                        c.forwarded.fetch_add(1, Ordering::Relaxed);
                        resp.len()
                    }
                };
                client.write_all(&resp[..cut]).await?;
                client.shutdown().await
            }
        }
    }
}

/// A client of the fixture's bucket whose requests go through `proxy`.
pub(crate) fn through(f: &Fixture, proxy: &fault_proxy::FaultProxy) -> S3 {
    S3::connect(
        f.server
            .config("data")
            .endpoint(format!("http://{}", proxy.addr)),
    )
    .unwrap()
}

pub(crate) fn proxy_to(f: &Fixture, faults: bool) -> fault_proxy::FaultProxy {
    let upstream: std::net::SocketAddr = f
        .server
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    if faults {
        fault_proxy::FaultProxy::start(upstream, Duration::from_secs(3))
    } else {
        fault_proxy::FaultProxy::clean(upstream)
    }
}
