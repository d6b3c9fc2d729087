//! The Prometheus endpoint of `flowgate run` (feature `prometheus`): the library's renderer
//! and endpoint (`flowgate::prometheus`, the same the Python loaders' `metrics_port=` serves)
//! over the latest statistics snapshot, every series labelled with the rank. The metric names
//! are documented in the README.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use flowgate::prometheus::{rank_labels, render, Endpoint};
use flowgate::PipelineStats;

type Error = Box<dyn std::error::Error>;

/// The endpoint; [`update`](Self::update) publishes a statistics snapshot.
pub(crate) struct Exporter {
    latest: Arc<Mutex<PipelineStats>>,
    _endpoint: Endpoint,
}

impl Exporter {
    /// Starts the endpoint (on its own thread) on a loopback or other address.
    pub(crate) fn start(addr: SocketAddr) -> Result<Self, Error> {
        let latest = Arc::new(Mutex::new(PipelineStats::default()));
        let shown = Arc::clone(&latest);
        let labels = rank_labels();
        let endpoint = Endpoint::serve(addr, move || {
            render(&shown.lock().expect("metrics"), &labels)
        })
        .map_err(|e| format!("metrics.prometheus: {e}"))?;
        Ok(Self {
            latest,
            _endpoint: endpoint,
        })
    }

    /// Publishes `stats` (counters are totals since the start).
    pub(crate) fn update(&self, stats: &PipelineStats) {
        *self.latest.lock().expect("metrics") = stats.clone();
    }
}
