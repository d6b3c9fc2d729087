//! The local S3 server of `serve_locally_from` (feature `s3`; the server needs
//! `test-util`): a pipeline file's demo and tests read an S3 prefix filled from local files.

use std::path::PathBuf;

use flowgate_actors::error::PipelineError;

use crate::dataset::Files;
use crate::s3::{S3Error, S3};

/// A local S3 server and its folder, removed when dropped.
#[cfg(feature = "test-util")]
#[derive(Debug)]
struct LocalS3 {
    _server: crate::s3::LocalServer,
    dir: PathBuf,
}

#[cfg(feature = "test-util")]
impl Drop for LocalS3 {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An S3 client for a local server on 127.0.0.1 holding the files of `list` under `prefix`
/// (the demo path of `serve_locally_from`); the server lives as long as the returned value.
#[cfg(feature = "test-util")]
pub(super) fn serve_locally(
    bucket: &str,
    prefix: &str,
    list: &std::path::Path,
) -> Result<(S3, Option<Box<dyn std::fmt::Debug + Send>>), PipelineError> {
    use crate::s3::LocalServer;
    let s3_err = |e: S3Error| PipelineError::io("the local S3 server", e);
    let dir = std::env::temp_dir().join(format!(
        "flowgate-local-s3-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let server = LocalServer::start(&dir)
        .map_err(|e| PipelineError::io("starting the local S3 server", e))?;
    let s3 = S3::connect(server.config(bucket)).map_err(s3_err)?;
    futures::executor::block_on(s3.create_bucket()).map_err(s3_err)?;
    for path in Files::list(list)?.epoch(0) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(&path)
            .map_err(|e| PipelineError::io(format!("reading {}", path.display()), e))?;
        futures::executor::block_on(s3.put(&format!("{prefix}{name}"), bytes)).map_err(s3_err)?;
    }
    let local = LocalS3 {
        _server: server,
        dir,
    };
    Ok((s3, Some(Box::new(local))))
}

#[cfg(not(feature = "test-util"))]
pub(super) fn serve_locally(
    _bucket: &str,
    _prefix: &str,
    _list: &std::path::Path,
) -> Result<(S3, Option<Box<dyn std::fmt::Debug + Send>>), PipelineError> {
    Err(PipelineError::config(
        "source.serve_locally_from needs flowgate built with the `test-util` feature",
    ))
}
