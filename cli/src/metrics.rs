//! The Prometheus endpoint of `flowgate run` (feature `prometheus`): the pipeline's statistics
//! as gauges and counters, served by `metrics-exporter-prometheus`'s HTTP listener on a
//! loopback address. The metric names are documented in the README.

use std::net::SocketAddr;

use flowgate::PipelineStats;
use metrics::{counter, gauge};

type Error = Box<dyn std::error::Error>;

/// The installed exporter; [`update`](Self::update) publishes a statistics snapshot.
pub(crate) struct Exporter;

impl Exporter {
    /// Installs the global recorder and starts the listener (on its own thread).
    pub(crate) fn start(addr: SocketAddr) -> Result<Self, Error> {
        // Every series carries the rank (torchrun's `RANK`, `LOCAL_RANK`; 0 alone), so the
        // ranks of a node scraped together stay apart.
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "0".to_owned());
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .add_global_label("rank", var("RANK"))
            .add_global_label("local_rank", var("LOCAL_RANK"))
            .install()
            .map_err(|e| format!("metrics.prometheus: serving on {addr}: {e}"))?;
        Ok(Self)
    }

    /// Publishes `stats` (counters are absolute: the statistics are totals since the start).
    pub(crate) fn update(&self, stats: &PipelineStats) {
        counter!("flowgate_delivered_total").absolute(stats.delivered);
        counter!("flowgate_failures_total").absolute(stats.failures);
        gauge!("flowgate_consumer_wait_seconds_total").set(stats.consumer_wait.as_secs_f64());
        gauge!("flowgate_epoch").set(stats.epoch as f64);
        for s in &stats.stages {
            let stage = s.name.clone();
            gauge!("flowgate_stage_workers", "stage" => stage.clone()).set(s.workers as f64);
            counter!("flowgate_stage_items_in_total", "stage" => stage.clone())
                .absolute(s.items_in);
            counter!("flowgate_stage_items_out_total", "stage" => stage.clone())
                .absolute(s.items_out);
            counter!("flowgate_stage_failures_total", "stage" => stage.clone())
                .absolute(s.failures);
            gauge!("flowgate_stage_queue_items", "stage" => stage.clone())
                .set(s.queue_items as f64);
            gauge!("flowgate_stage_queue_bytes", "stage" => stage.clone())
                .set(s.queue_bytes as f64);
            gauge!("flowgate_stage_budget_items", "stage" => stage.clone())
                .set(s.budget_items as f64);
            gauge!("flowgate_stage_busy_seconds_total", "stage" => stage.clone())
                .set(s.busy.as_secs_f64());
            gauge!("flowgate_stage_blocked_put_seconds_total", "stage" => stage.clone())
                .set(s.blocked_put.as_secs_f64());
            gauge!("flowgate_stage_blocked_get_seconds_total", "stage" => stage.clone())
                .set(s.blocked_get.as_secs_f64());
            gauge!("flowgate_stage_task_p50_seconds", "stage" => stage.clone())
                .set(s.task_time.p50.as_secs_f64());
            gauge!("flowgate_stage_task_p99_seconds", "stage" => stage.clone())
                .set(s.task_time.p99.as_secs_f64());
            if let Some(c) = s.cache {
                gauge!("flowgate_cache_capacity_bytes", "stage" => stage.clone())
                    .set(c.capacity_bytes as f64);
                gauge!("flowgate_cache_bytes", "stage" => stage.clone()).set(c.bytes as f64);
                counter!("flowgate_cache_hits_total", "stage" => stage.clone()).absolute(c.hits);
                counter!("flowgate_cache_misses_total", "stage" => stage.clone())
                    .absolute(c.misses);
                counter!("flowgate_cache_evicted_bytes_total", "stage" => stage)
                    .absolute(c.evicted_bytes);
            }
        }
    }
}
