//! [`LocalServer`] (feature `test-util`): a real S3-compatible server for tests and demos.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::config::S3Config;

/// A local S3-compatible server (`s3s-fs`) serving a directory on 127.0.0.1 at a free port, for
/// tests, examples and trying a pipeline without a cloud account. Each top-level folder of the
/// root is a bucket. The server stops when this value drops.
///
/// `scripts/setup.sh --test` installs the binary once per machine into
/// `~/.cache/flowgate/tools/bin/s3s-fs`;
/// [`LocalServer::binary`] finds it there (or at `$FLOWGATE_S3S_FS`).
#[derive(Debug)]
pub struct LocalServer {
    child: std::process::Child,
    endpoint: String,
    root: PathBuf,
}

impl LocalServer {
    /// The access key the server accepts.
    pub const ACCESS_KEY: &'static str = "flowgate";
    /// The secret the server accepts.
    pub const SECRET_KEY: &'static str = "flowgate-secret";

    /// The `s3s-fs` binary: `$FLOWGATE_S3S_FS`, else the one `scripts/setup.sh` installs once
    /// per machine (`$HOME/.cache/flowgate/tools/bin/s3s-fs`), as the test virtualenv is.
    pub fn binary() -> PathBuf {
        if let Some(path) = std::env::var_os("FLOWGATE_S3S_FS") {
            return PathBuf::from(path);
        }
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        home.join(".cache/flowgate/tools/bin/s3s-fs")
    }

    /// Starts the server over `root` (created if missing) and waits until it accepts
    /// connections (10 s at most).
    pub fn start(root: impl AsRef<Path>) -> std::io::Result<Self> {
        let root = root.as_ref().to_path_buf();
        std::fs::create_dir_all(&root)?;
        let binary = Self::binary();
        if !binary.exists() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "{} is missing: run scripts/setup.sh (it installs s3s-fs), or set FLOWGATE_S3S_FS",
                    binary.display()
                ),
            ));
        }
        let mut last = None;
        // A free port can be taken between probing and binding: try a few.
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let mut child = std::process::Command::new(&binary)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--access-key", Self::ACCESS_KEY])
                .args(["--secret-key", Self::SECRET_KEY])
                .arg(&root)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()?;
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            loop {
                if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                    return Ok(Self {
                        child,
                        endpoint: format!("http://127.0.0.1:{port}"),
                        root,
                    });
                }
                if let Some(status) = child.try_wait()? {
                    last = Some(format!("s3s-fs exited with {status}"));
                    break;
                }
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    last = Some("s3s-fs did not accept connections within 10 s".into());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(std::io::Error::other(last.unwrap_or_default()))
    }

    /// The server's URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The directory it serves.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A configuration for `bucket` on this server, with its credentials.
    pub fn config(&self, bucket: &str) -> S3Config {
        S3Config::new(bucket)
            .endpoint(&self.endpoint)
            .region("us-east-1")
            .credentials(Self::ACCESS_KEY, Self::SECRET_KEY)
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
