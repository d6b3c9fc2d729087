//! The device uploader: CPU and simulated backends, the staging ring's reuse rule (with a
//! controllable fake event), the uploader as a pipeline stage, and CUDA: on a machine without
//! it, a clear error and the CPU fallback; on a machine with a GPU (`scripts/gpu-check.sh`),
//! real uploads read back.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use flowgate::device::{
    Backend, CopyEvent, Cpu, Cuda, DeviceBatch, DeviceError, DeviceMemory, Simulated, Staging,
    Uploader,
};
use flowgate::{DType, Pipeline, Tensor};

fn batch(fill: u8, n: usize) -> Tensor {
    let mut t = Tensor::zeros(&[n, 3, 4, 4], DType::U8);
    for (i, b) in t.bytes_mut().iter_mut().enumerate() {
        *b = fill.wrapping_add(i as u8);
    }
    t
}

#[test]
fn cpu_backend_passes_batches_through() {
    let mut up = Uploader::new(Cpu);
    for k in 0..5u8 {
        let t = batch(k, 2);
        let d = up.upload(&t).unwrap();
        assert!(d.is_ready());
        assert_eq!(d.shape(), t.shape());
        assert_eq!(d.dtype(), DType::U8);
        assert_eq!(d.host_bytes(), Some(t.bytes()));
    }
    let s = up.stats();
    assert_eq!((s.batches, s.bytes, s.slot_waits), (5, 5 * 96, 0));
    assert_eq!(s.depth, 1, "copies complete at once: one slot is enough");
}

#[test]
fn simulated_copies_take_their_time_in_order() {
    let link = Simulated::new(1e6, Duration::from_millis(2)); // 1 MB/s: 96 B take 96 µs
    let per_copy = link.copy_time(96);
    let mut up = Uploader::new(link);
    let t0 = Instant::now();
    let batches: Vec<DeviceBatch> = (0..4).map(|k| up.upload(&batch(k, 2)).unwrap()).collect();
    for (k, b) in batches.iter().enumerate() {
        b.wait().unwrap();
        assert!(
            t0.elapsed() >= per_copy * (k as u32 + 1),
            "copy {k} completed before the link could carry it"
        );
        assert_eq!(b.to_host().unwrap(), batch(k as u8, 2).bytes());
    }
    assert!(up.stats().depth >= 2, "busy slots made the ring grow");
}

/// A backend whose copies complete only when the test says so, and which checks the rule:
/// when a copy completes, its staging bytes are still what they were when it started.
#[derive(Debug, Default)]
struct Manual {
    copies: Mutex<Vec<Arc<ManualEvent>>>,
    violations: AtomicUsize,
}

#[derive(Debug)]
struct ManualEvent {
    done: Mutex<bool>,
    cv: Condvar,
    /// The staging memory the copy reads, and what it held when the copy started.
    src: *const u8,
    snapshot: Vec<u8>,
    backend: *const Manual,
}

// SAFETY: the raw pointers are only read while the test keeps the uploader (and so the staging
// memory) and the backend alive.
unsafe impl Send for ManualEvent {}
unsafe impl Sync for ManualEvent {}

impl ManualEvent {
    fn complete(&self) {
        if self.is_complete() {
            return;
        }
        // The copy engine reads the source now: it must be unchanged.
        let now = unsafe { std::slice::from_raw_parts(self.src, self.snapshot.len()) };
        if now != &self.snapshot[..] {
            unsafe { &*self.backend }
                .violations
                .fetch_add(1, Ordering::SeqCst);
        }
        *self.done.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

impl CopyEvent for ManualEvent {
    fn is_complete(&self) -> bool {
        *self.done.lock().unwrap()
    }
    fn wait(&self) -> Result<(), DeviceError> {
        let mut d = self.done.lock().unwrap();
        while !*d {
            d = self.cv.wait(d).unwrap();
        }
        Ok(())
    }
}

/// The backend side of [`Manual`].
#[derive(Clone, Debug)]
struct Fake(Arc<Manual>);

impl Backend for Fake {
    fn name(&self) -> String {
        "manual".into()
    }
    fn staging(&self, bytes: usize) -> Result<Staging, DeviceError> {
        Ok(Staging::Host(vec![0; bytes]))
    }
    fn copy(
        &self,
        src: &Staging,
        len: usize,
    ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError> {
        let bytes = src.as_bytes()?;
        let ev = Arc::new(ManualEvent {
            done: Mutex::new(false),
            cv: Condvar::new(),
            src: bytes.as_ptr(),
            snapshot: bytes[..len].to_vec(),
            backend: Arc::as_ptr(&self.0),
        });
        self.0.copies.lock().unwrap().push(Arc::clone(&ev));
        Ok((DeviceMemory::Host(bytes[..len].to_vec()), ev))
    }
}

#[test]
fn a_staging_slot_is_never_reused_before_its_copy_completes() {
    let manual = Arc::new(Manual::default());
    // Room for two 96-byte slots.
    let up = Arc::new(Mutex::new(
        Uploader::new(Fake(Arc::clone(&manual))).max_staging_bytes(2 * 96),
    ));
    let b0 = up.lock().unwrap().upload(&batch(10, 2)).unwrap();
    let b1 = up.lock().unwrap().upload(&batch(20, 2)).unwrap();
    assert_eq!(
        up.lock().unwrap().stats().depth,
        2,
        "a second slot while the first is busy"
    );
    assert!(!b0.is_ready() && !b1.is_ready());

    // The third batch needs slot 0, whose copy is still running: it must wait.
    let returned = Arc::new(AtomicBool::new(false));
    let (u, r) = (Arc::clone(&up), Arc::clone(&returned));
    let third = std::thread::spawn(move || {
        let b = u.lock().unwrap().upload(&batch(30, 2)).unwrap();
        r.store(true, Ordering::SeqCst);
        b
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !returned.load(Ordering::SeqCst),
        "slot 0 was reused while its copy was in flight"
    );
    let first = Arc::clone(&manual.copies.lock().unwrap()[0]);
    first.complete();
    let b2 = third.join().unwrap();
    assert!(returned.load(Ordering::SeqCst));
    for ev in manual.copies.lock().unwrap().iter() {
        ev.complete();
    }
    assert_eq!(manual.violations.load(Ordering::SeqCst), 0);
    let s = up.lock().unwrap().stats();
    assert_eq!((s.depth, s.slot_waits, s.batches), (2, 1, 3));
    for (b, fill) in [(&b0, 10), (&b1, 20), (&b2, 30)] {
        assert_eq!(b.to_host().unwrap(), batch(fill, 2).bytes());
    }
}

/// The check in `Manual` catches a ring that overwrites a slot early: an uploader that does
/// not wait (a backend whose events claim completion at once) lets the fake see the
/// overwrite when it completes the copy late.
#[test]
fn the_fake_event_detects_early_reuse() {
    #[derive(Debug)]
    struct Liar(Fake);
    #[derive(Debug)]
    struct AlwaysDone;
    impl CopyEvent for AlwaysDone {
        fn is_complete(&self) -> bool {
            true
        }
        fn wait(&self) -> Result<(), DeviceError> {
            Ok(())
        }
    }
    impl Backend for Liar {
        fn name(&self) -> String {
            "liar".into()
        }
        fn staging(&self, bytes: usize) -> Result<Staging, DeviceError> {
            self.0.staging(bytes)
        }
        fn copy(
            &self,
            src: &Staging,
            len: usize,
        ) -> Result<(DeviceMemory, Arc<dyn CopyEvent>), DeviceError> {
            let (mem, _real) = self.0.copy(src, len)?;
            Ok((mem, Arc::new(AlwaysDone)))
        }
    }
    let manual = Arc::new(Manual::default());
    let mut up = Uploader::new(Liar(Fake(Arc::clone(&manual)))).max_staging_bytes(96);
    let _a = up.upload(&batch(1, 2)).unwrap();
    let _b = up.upload(&batch(2, 2)).unwrap(); // same slot, the first copy "still running"
    manual.copies.lock().unwrap()[0].complete();
    assert_eq!(manual.violations.load(Ordering::SeqCst), 1);
}

#[test]
fn the_uploader_is_the_last_stage_of_a_pipeline() {
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..50u8)
        .pipe(
            "make",
            |k: u8| Ok::<_, DeviceError>(batch(k, 1).reshaped(&[3, 4, 4])),
            2,
        )
        .aggregate(8, false)
        .pipe(
            "collate",
            |v: Vec<Tensor>| Ok::<_, DeviceError>(Tensor::stack(&v).expect("same shapes")),
            1,
        )
        .upload(Uploader::new(Simulated::new(
            1e9,
            Duration::from_micros(50),
        )))
        .build()
        .unwrap();
    let mut items = 0;
    for b in p.iter() {
        let b = b.unwrap();
        b.wait().unwrap();
        assert_eq!(&b.shape()[1..], [3, 4, 4]);
        items += b.shape()[0];
        assert_eq!(b.to_host().unwrap().len(), b.nbytes());
    }
    assert_eq!(items, 50);
    assert!(p.stats().stage("upload").is_some());
}

/// Without a GPU (CI): a clear `Unavailable`, never a panic, and the CPU fallback. With one
/// (`scripts/gpu-check.sh` sets FLOWGATE_REQUIRE_GPU=1): uploads through pinned staging on a
/// stream, read back equal, batches of several sizes, the ring reused.
#[test]
fn cuda_uploads_or_says_clearly_why_not() {
    match Cuda::new(0) {
        Err(DeviceError::Unavailable(why)) => {
            assert!(
                std::env::var("FLOWGATE_REQUIRE_GPU").is_err(),
                "a GPU was required: {why}"
            );
            assert!(!why.is_empty());
            let (mut up, reason) = Uploader::cuda_or_cpu(0);
            assert!(reason.is_some());
            assert_eq!(up.backend_name(), "cpu");
            assert!(up.upload(&batch(1, 1)).unwrap().is_ready());
            assert!(Cuda::new(7).is_err());
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(cuda) => {
            let name = cuda.name();
            let mut up = Uploader::new(cuda).max_staging_bytes(64 << 20);
            assert_eq!(name, "cuda:0");
            let mut held = Vec::new();
            for k in 0..40u8 {
                let n = 1 + (k as usize % 5) * 1000;
                let t = batch(k, n);
                let d = up.upload(&t).unwrap();
                if k % 3 == 0 {
                    assert_eq!(d.to_host().unwrap(), t.bytes(), "batch {k}");
                }
                held.push((d, t));
            }
            for (d, t) in &held {
                assert_eq!(d.to_host().unwrap(), t.bytes());
            }
            let s = up.stats();
            assert_eq!(s.batches, 40);
            eprintln!("cuda ring: {s:?}");
        }
    }
}

/// A GPU utilisation sampler reaches the tuner every tick and shows in its trace.
#[test]
fn the_tuner_samples_gpu_utilisation() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let mut p = Pipeline::builder()
        .source_epochs(|_| 0..300u64)
        .pipe("work", |x: u64| Ok::<_, DeviceError>(x), 1)
        .autotune(flowgate::TunerSettings {
            tick: Some(Duration::from_millis(10)),
            ..Default::default()
        })
        .gpu_utilization(move || {
            c.fetch_add(1, Ordering::Relaxed);
            Some(0.42)
        })
        .build()
        .unwrap();
    for x in p.iter() {
        x.unwrap();
        std::thread::sleep(Duration::from_micros(500));
    }
    assert!(calls.load(Ordering::Relaxed) >= 3, "sampled every tick");
    let trace = p.tuner_trace();
    assert!(!trace.is_empty());
    assert!(trace.iter().all(|r| r.gpu_util == Some(0.42)));
}

/// The staging ring is part of the memory budget: `upload` reserves its limit, the buffers
/// share what is left (and the tuner keeps them there), and a budget the ring alone exceeds is
/// an error at build that names it.
#[test]
fn the_staging_ring_is_reserved_in_the_memory_budget() {
    const BUDGET: u64 = 32 << 20;
    const RING: usize = 8 << 20;
    let build = |ring: Option<usize>| {
        let up = Uploader::new(Simulated::new(1e8, Duration::from_micros(200)));
        let up = match ring {
            Some(r) => up.max_staging_bytes(r),
            None => up,
        };
        Pipeline::builder()
            .source_epochs(|_| 0..40u8)
            .pipe("make", |k: u8| Ok::<_, DeviceError>(batch(k, 1 << 14)), 2)
            .memory_budget(BUDGET)
            .upload(up)
            .build()
    };
    let mut p = build(Some(RING)).unwrap();
    let monitor = p.monitor();
    let limits = |m: &flowgate::Monitor| -> u64 {
        m.stats()
            .stages
            .iter()
            .map(|s| s.budget_bytes)
            .filter(|&b| b < u64::MAX)
            .sum()
    };
    assert!(
        limits(&monitor) <= BUDGET - RING as u64,
        "the buffers' limits ({} bytes) leave the ring its {RING}",
        limits(&monitor)
    );
    let mut n = 0;
    for b in p.iter() {
        b.unwrap().wait().unwrap();
        n += 1;
        assert!(
            limits(&monitor) <= BUDGET - RING as u64,
            "the tuner keeps them there"
        );
    }
    assert_eq!(n, 40);
    // The default ring (1 GiB) does not fit a 32 MiB budget: said at build.
    let e = build(None).unwrap_err();
    assert!(
        e.is_config() && e.to_string().contains("staging ring"),
        "{e}"
    );
}

/// The consumer's side of a device batch, on the simulated backend's record: making a batch
/// ready on the consumer's stream queues a wait there (the host never blocks for it), the
/// memory is freed after the work on that stream, and the device bytes waiting for the
/// consumer stay within `max_device_bytes` while the consumer is slower than the pipeline.
#[test]
fn device_batches_wait_on_the_consumers_stream_and_stay_within_the_device_budget() {
    use flowgate::device::SimRecord;
    const BATCH: usize = 8 * 48; // 8 items of 48 bytes
    let run = |limit: Option<u64>| {
        let link = Simulated::new(1e8, Duration::from_millis(2));
        let log = link.log();
        let up = Uploader::new(link).max_staging_bytes(1 << 20);
        let up = match limit {
            Some(l) => up.max_device_bytes(l),
            None => up,
        };
        let mut p = Pipeline::builder()
            .source_epochs(|_| 0..240u8)
            .pipe("make", |k: u8| Ok::<_, DeviceError>(batch(k, 1)), 2)
            .aggregate(8, false)
            .pipe(
                "collate",
                |v: Vec<Tensor>| Ok::<_, DeviceError>(Tensor::stack(&v).expect("same shapes")),
                1,
            )
            .upload(up)
            .build()
            .unwrap();
        let mut seen = Vec::new();
        for (k, b) in p.iter().enumerate() {
            let b = b.unwrap();
            let stream = 0x7000 + k % 2; // two consumer streams, as handles
            b.ready_on_stream(Some(stream)).unwrap();
            b.ready_on_stream(Some(stream)).unwrap(); // twice: remembered once
            if k == 0 {
                b.ready_on_stream(None).unwrap(); // DLPack's default: the legacy stream
            }
            // Contents (read without waiting: the simulated device is host memory).
            let host = b.host_bytes().unwrap().to_vec();
            seen.push(host[0]);
            std::thread::sleep(Duration::from_millis(3)); // a slow training step
            drop(b);
        }
        (seen, log)
    };
    let (seen, log) = run(Some(3 * BATCH as u64));
    let firsts: std::collections::BTreeSet<u8> = seen.iter().copied().collect();
    assert_eq!(firsts.len(), 30, "every batch once");
    let records = log.records();
    let copies = records
        .iter()
        .filter(|r| matches!(r, SimRecord::Copy { .. }))
        .count();
    assert_eq!(copies, 30);
    for r in &records {
        match r {
            SimRecord::HostWait { thread, .. } => assert!(
                thread
                    .as_deref()
                    .is_some_and(|t| t.starts_with("fg-upload")),
                "only the uploader's ring may block the host on a copy, not {thread:?}: {r:?}"
            ),
            SimRecord::Free { id, streams, .. } => {
                let mut want = vec![0x7000 + *id as usize % 2];
                if *id == 0 {
                    want.push(1);
                }
                want.sort();
                let mut got = streams.clone();
                got.sort();
                assert_eq!(got, want, "copy {id}'s free waits for its consumer streams");
            }
            _ => {}
        }
    }
    let waits = records
        .iter()
        .filter(|r| matches!(r, SimRecord::StreamWait { .. }))
        .count();
    assert_eq!(waits, 30 * 2 + 1, "each ready_on_stream queues its wait");
    assert_eq!(log.live_bytes(), 0, "every batch freed");
    // Waiting for the consumer: at most the budget (3 batches), plus the batch the upload
    // worker holds while the buffer is full and the one the consumer holds.
    assert!(
        log.peak_live_bytes() <= 5 * BATCH as u64,
        "{} device bytes live at once, budget {}",
        log.peak_live_bytes(),
        3 * BATCH
    );
    // Without a device budget the same slow consumer lets far more pile up on the device:
    // the bound above is the budget's doing.
    let (_, unbounded) = run(None);
    assert!(
        unbounded.peak_live_bytes() > 5 * BATCH as u64,
        "{} bytes",
        unbounded.peak_live_bytes()
    );
}
