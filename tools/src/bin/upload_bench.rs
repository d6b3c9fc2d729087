//! Host-to-device upload benchmark, and an image pipeline feeding a simulated training step.
//!
//! ```text
//! cargo run --release -p flowgate-tools --features cuda --bin upload_bench -- [--backend cuda|simulated|cpu]
//!     [--sizes 1,4,16,64] [--reps 20]
//! cargo run --release -p flowgate-tools --features cuda --bin upload_bench -- --e2e --list FILE
//!     [--backend ..] [--batch 32] [--step-ms 10] [--epochs 2]
//! ```
//!
//! Bandwidth (one JSON line per batch size, MiB): H2D GB/s from pageable memory, from plain
//! pinned memory (`cuMemHostAlloc`), through the uploader from ordinary tensors (a staging
//! copy into its pinned ring, overlapped with the previous DMA), and through the uploader from
//! tensors made by its `host_alloc` (pinned pool: no staging copy), with the uploader's ratios
//! to pinned. Without CUDA only the uploader rows run (simulated: a 25 GB/s link).
//!
//! `--e2e`: decode + resize 256 + crop 224 → batches collated into the uploader's pinned
//! memory → upload → a training step of `--step-ms` on the GPU (a spin kernel timed with
//! `%globaltimer` on its own stream, which waits on each batch's copy event). Reports images/s
//! and the fraction of the GPU's time spent waiting for data (1 - kernel time / wall time
//! between the first kernel's start and the last one's end, from CUDA events). Without CUDA
//! the step is a host sleep and the wait is the consumer's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flowgate::dataset::Files;
use flowgate::device::{
    Backend, Cpu, Cuda, DeviceBatch, DeviceError, GpuMonitor, Simulated, Uploader,
};
use flowgate::media::image::ImageRecipe;
use flowgate::{DType, Pipeline, PipelineError, Tensor};

struct Args {
    backend: String,
    sizes: Vec<usize>,
    reps: usize,
    e2e: bool,
    list: Option<String>,
    batch: usize,
    step_ms: f64,
    epochs: u64,
}

fn parse() -> Args {
    let mut a = Args {
        backend: "cuda".into(),
        sizes: vec![1, 4, 16, 64],
        reps: 20,
        e2e: false,
        list: None,
        batch: 32,
        step_ms: 10.0,
        epochs: 2,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        if flag == "--e2e" {
            a.e2e = true;
            continue;
        }
        let v = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => a.backend = v.clone(),
            "--sizes" => a.sizes = v.split(',').map(|s| s.parse().expect("--sizes")).collect(),
            "--reps" => a.reps = v.parse().expect("--reps"),
            "--list" => a.list = Some(v.clone()),
            "--batch" => a.batch = v.parse().expect("--batch"),
            "--step-ms" => a.step_ms = v.parse().expect("--step-ms"),
            "--epochs" => a.epochs = v.parse().expect("--epochs"),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn gbps(bytes: usize, reps: usize, secs: f64) -> f64 {
    (bytes * reps) as f64 / secs / 1e9
}

/// Uploads `reps` batches of `bytes`, `make` making each; waits for every copy.
fn through_uploader(
    up: &mut Uploader,
    reps: usize,
    mut make: impl FnMut() -> Tensor,
) -> Result<f64, DeviceError> {
    let mut held: std::collections::VecDeque<DeviceBatch> = Default::default();
    // Warm-up: grow the ring and the pool.
    for _ in 0..4 {
        held.push_back(up.upload_owned(make())?);
    }
    for b in held.drain(..) {
        b.wait()?;
    }
    let t0 = Instant::now();
    for _ in 0..reps {
        held.push_back(up.upload_owned(make())?);
        // The consumer holds a few batches, like a training loop with prefetch.
        if held.len() > 3 {
            held.pop_front().expect("held").wait()?;
        }
    }
    for b in held.drain(..) {
        b.wait()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn backend(name: &str) -> Result<Arc<dyn Backend>, DeviceError> {
    Ok(match name {
        "cuda" => Arc::new(Cuda::new(0)?),
        "simulated" => Arc::new(Simulated::new(25e9, Duration::from_micros(10))),
        "cpu" => Arc::new(Cpu),
        other => panic!("unknown backend {other} (cuda, simulated, cpu)"),
    })
}

fn bandwidth(a: &Args) -> Result<(), DeviceError> {
    let be = backend(&a.backend)?;
    for &mib in &a.sizes {
        let bytes = mib << 20;
        let shape = [bytes];
        #[cfg(feature = "cuda")]
        let (pageable, pinned) = match &a.backend[..] {
            "cuda" => {
                let (p, q) = cuda_baselines(bytes, a.reps)?;
                (Some(p), Some(q))
            }
            _ => (None, None),
        };
        #[cfg(not(feature = "cuda"))]
        let (pageable, pinned): (Option<f64>, Option<f64>) = (None, None);

        let mut up = Uploader::with_backend(Arc::clone(&be));
        let src = {
            let mut t = Tensor::zeros(&shape, DType::U8);
            t.bytes_mut()
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = i as u8);
            t
        };
        let staged = through_uploader(&mut up, a.reps, || {
            let mut t = Tensor::zeros(&shape, DType::U8);
            t.bytes_mut().copy_from_slice(src.bytes());
            t
        })?;
        // The staged path above includes making each tensor; time that alone and take it out.
        let t0 = Instant::now();
        for _ in 0..a.reps {
            let mut t = Tensor::zeros(&shape, DType::U8);
            t.bytes_mut().copy_from_slice(src.bytes());
            std::hint::black_box(&t);
        }
        let making = t0.elapsed().as_secs_f64();
        let staged_gbps = gbps(bytes, a.reps, (staged - making).max(1e-9));

        let mut up = Uploader::with_backend(Arc::clone(&be));
        let alloc = up.host_alloc();
        let direct = through_uploader(&mut up, a.reps, || alloc.tensor(&shape, DType::U8))?;
        let direct_gbps = gbps(bytes, a.reps, direct);
        let ratio = |x: f64| pinned.map(|p| x / p);
        println!(
            "{{\"backend\":\"{}\",\"mib\":{mib},\"reps\":{},\"pageable_gbps\":{},\"pinned_gbps\":{},\
\"uploader_staged_gbps\":{staged_gbps:.2},\"uploader_direct_gbps\":{direct_gbps:.2},\
\"staged_vs_pinned\":{},\"direct_vs_pinned\":{},\"direct_batches\":{}}}",
            be.name(),
            a.reps,
            json(pageable),
            json(pinned),
            json(ratio(staged_gbps)),
            json(ratio(direct_gbps)),
            up.stats().direct,
        );
    }
    Ok(())
}

fn json(x: Option<f64>) -> String {
    x.map_or("null".into(), |v| format!("{v:.3}"))
}

/// GB/s of plain copies from pageable and from pinned memory, on one stream.
#[cfg(feature = "cuda")]
fn cuda_baselines(bytes: usize, reps: usize) -> Result<(f64, f64), DeviceError> {
    let cuda = Cuda::new(0)?;
    let (ctx, stream) = (cuda.context(), cuda.stream());
    let err = |e: flowgate::device::cudarc::driver::DriverError| DeviceError::Driver(e.to_string());
    // SAFETY: device memory, only written by the copies.
    let mut dst = unsafe { stream.alloc::<u8>(bytes) }.map_err(err)?;
    let pageable = vec![7u8; bytes];
    // SAFETY: filled right below before any copy.
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(err)?;
    pinned.as_mut_slice().map_err(err)?.fill(7);
    let mut time = |pinned_src: bool| -> Result<f64, DeviceError> {
        for _ in 0..2 {
            if pinned_src {
                stream.memcpy_htod(&pinned, &mut dst).map_err(err)?;
            } else {
                stream.memcpy_htod(&pageable, &mut dst).map_err(err)?;
            }
        }
        stream.synchronize().map_err(err)?;
        let t0 = Instant::now();
        for _ in 0..reps {
            if pinned_src {
                stream.memcpy_htod(&pinned, &mut dst).map_err(err)?;
            } else {
                stream.memcpy_htod(&pageable, &mut dst).map_err(err)?;
            }
        }
        stream.synchronize().map_err(err)?;
        Ok(gbps(bytes, reps, t0.elapsed().as_secs_f64()))
    };
    Ok((time(false)?, time(true)?))
}

/// The training step: a spin kernel of a fixed duration on the compute stream.
#[cfg(feature = "cuda")]
mod step {
    use std::sync::Arc;

    use flowgate::device::cudarc::driver::{
        CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
    };
    use flowgate::device::cudarc::nvrtc::Ptx;
    use flowgate::device::DeviceError;

    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry spin(
    .param .u64 spin_param_0
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [spin_param_0];
    mov.u64 %rd2, %globaltimer;
$L__spin:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L__spin;
    ret;
}
"#;

    fn err(e: impl std::fmt::Display) -> DeviceError {
        DeviceError::Driver(e.to_string())
    }

    pub(crate) struct Step {
        pub(crate) stream: Arc<CudaStream>,
        f: CudaFunction,
        ns: u64,
    }

    impl Step {
        pub(crate) fn new(ctx: &Arc<CudaContext>, ms: f64) -> Result<Self, DeviceError> {
            let module = ctx.load_module(Ptx::from_src(PTX)).map_err(err)?;
            Ok(Self {
                stream: ctx.new_stream().map_err(err)?,
                f: module.load_function("spin").map_err(err)?,
                ns: (ms * 1e6) as u64,
            })
        }

        /// Waits (on the GPU) for `ready`, then runs one step; returns events around it.
        pub(crate) fn run(&self, ready: &CudaEvent) -> Result<(CudaEvent, CudaEvent), DeviceError> {
            self.stream.wait(ready).map_err(err)?;
            let timing =
                Some(flowgate::device::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = self.stream.record_event(timing).map_err(err)?;
            let mut b = self.stream.launch_builder(&self.f);
            b.arg(&self.ns);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the kernel takes one u64 by value and touches no memory.
            unsafe { b.launch(cfg) }.map_err(err)?;
            let end = self.stream.record_event(timing).map_err(err)?;
            Ok((start, end))
        }
    }
}

#[cfg(feature = "cuda")]
type CudaEventT = flowgate::device::cudarc::driver::CudaEvent;

fn e2e(a: &Args) -> Result<(), PipelineError> {
    let list = a.list.as_deref().expect("--e2e needs --list FILE");
    let files = Files::list(list)?.shuffle(0);
    let n_files = files.len();
    let be = backend(&a.backend).map_err(|e| PipelineError::config(e.to_string()))?;
    let up = Uploader::with_backend(Arc::clone(&be));
    let alloc = up.host_alloc();
    let recipe = ImageRecipe::default();
    // The tuner sees GPU utilisation where NVML is there.
    let monitor = GpuMonitor::new(0).ok();
    let gpu_monitored = monitor.is_some();
    let mut p = Pipeline::builder()
        .source_epochs(move |e| files.epoch(e))
        .pipe_async(
            "read",
            |path: std::path::PathBuf| async move {
                let bytes = tokio::fs::read(&path).await?;
                Ok::<_, std::io::Error>((path, bytes))
            },
            4,
        )
        .pipe(
            "decode",
            move |(path, bytes): (std::path::PathBuf, Vec<u8>)| recipe.decode(&bytes, &path),
            1,
        )
        .measure(Tensor::nbytes)
        .aggregate(a.batch, false)
        .pipe("collate", move |v: Vec<Tensor>| alloc.collate(&v), 1)
        .measure(Tensor::nbytes)
        .upload(up)
        .gpu_utilization(move || monitor.as_ref().and_then(GpuMonitor::utilization))
        .build()?;

    #[cfg(feature = "cuda")]
    let step = match &a.backend[..] {
        "cuda" => {
            let cuda = Cuda::new(0).map_err(|e| PipelineError::config(e.to_string()))?;
            Some(
                step::Step::new(cuda.context(), a.step_ms)
                    .map_err(|e| PipelineError::config(e.to_string()))?,
            )
        }
        _ => None,
    };
    let t0 = Instant::now();
    let mut images = 0usize;
    // Events around each GPU step; the batches the GPU may still be using.
    #[cfg(feature = "cuda")]
    let mut timeline: Vec<(CudaEventT, CudaEventT)> = Vec::new();
    #[cfg(feature = "cuda")]
    let mut in_use: std::collections::VecDeque<(DeviceBatch, usize)> = Default::default();
    for _ in 0..a.epochs {
        for b in p.iter() {
            let b = b?;
            images += b.shape()[0];
            #[cfg(feature = "cuda")]
            if let Some(step) = &step {
                let flowgate::device::DeviceMemory::Cuda(_, ready) = b.memory() else {
                    return Err(PipelineError::config("a CUDA batch expected"));
                };
                let (s, e) = step
                    .run(&ready.event)
                    .map_err(|e| PipelineError::config(e.to_string()))?;
                timeline.push((s, e));
                in_use.push_back((b, timeline.len() - 1));
                // The GPU runs at most two steps ahead of the host, like a training loop;
                // a batch is released once its step has finished.
                if in_use.len() > 2 {
                    let (old, i) = in_use.pop_front().expect("in use");
                    timeline[i]
                        .1
                        .synchronize()
                        .map_err(|e| PipelineError::config(e.to_string()))?;
                    drop(old);
                }
                continue;
            }
            b.wait().map_err(|e| PipelineError::config(e.to_string()))?;
            std::thread::sleep(Duration::from_secs_f64(a.step_ms / 1e3));
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let sink = p.stats();
    let consumer_wait = sink
        .stage("sink")
        .map_or(0.0, |s| s.blocked_get.as_secs_f64());
    #[allow(unused_mut)]
    let mut gpu_wait: Option<f64> = None;
    #[cfg(feature = "cuda")]
    if let (Some(first), Some(last)) = (timeline.first(), timeline.last()) {
        let err =
            |e: flowgate::device::cudarc::driver::DriverError| PipelineError::config(e.to_string());
        let wall = f64::from(first.0.elapsed_ms(&last.1).map_err(err)?);
        let mut busy = 0.0;
        for (s, e) in &timeline {
            busy += f64::from(s.elapsed_ms(e).map_err(err)?);
        }
        gpu_wait = Some((1.0 - busy / wall).max(0.0));
    }
    println!(
        "{{\"workload\":\"e2e-images\",\"backend\":\"{}\",\"files\":{n_files},\"images\":{images},\
\"seconds\":{secs:.3},\"images_per_s\":{:.1},\"step_ms\":{},\"steps_per_s_max\":{:.1},\
\"gpu_wait_fraction\":{},\"consumer_wait_fraction\":{:.4},\"nvml\":{gpu_monitored}}}",
        be.name(),
        images as f64 / secs,
        a.step_ms,
        1e3 / a.step_ms,
        json(gpu_wait),
        consumer_wait / secs,
    );
    Ok(())
}

fn main() {
    let a = parse();
    let r = if a.e2e {
        e2e(&a).map_err(|e| e.to_string())
    } else {
        bandwidth(&a).map_err(|e| e.to_string())
    };
    if let Err(e) = r {
        eprintln!("upload_bench: {e}");
        println!("{{\"error\":{:?}}}", e);
        std::process::exit(2);
    }
}
