"""The loaders' device path (``device=``) without a GPU: ``"simulated"`` runs the uploader
of ``device="cuda"`` on a simulated copy engine whose record says what a GPU would have been
asked to do (copies, the consumer's stream waits, host waits, frees and the streams they
waited for); ``"cuda"`` on a machine without a driver raises ``DeviceUnavailable`` at
construction. With ``FLOWGATE_REQUIRE_GPU=1`` (scripts/gpu-check.sh) the CUDA path itself runs.
"""
import gc
import os
import shutil
import time

import numpy as np
import pytest

import flowgate

HAS_GPU = os.environ.get("FLOWGATE_REQUIRE_GPU") == "1"


def loader(data, **kw):
    paths = (data / "images.txt").read_text().split()
    args = dict(batch_size=4, resize=32, crop=32, shuffle=True, seed=3, workers=1,
                labels=list(range(len(paths))), return_paths=True)
    args.update(kw)
    return flowgate.ImageLoader(data / "images.txt", **args), paths


def test_simulated_device_batches_match_the_cpu_ones_with_labels_aligned(data):
    cpu, paths = loader(data)
    dev, _ = loader(data, device="simulated")
    want = [(np.asarray(x).copy(), np.asarray(y).copy(), p) for x, y, p in cpu]
    got = []
    for x, y, p in dev:
        assert x.device == "simulated" and y.device == "simulated"
        assert "device=simulated" in repr(x)
        # Labels travel with the batch, aligned with the images (label i is file i).
        assert [paths[i] for i in np.from_dlpack(y)] == p
        got.append((np.from_dlpack(x).copy(), np.asarray(y).copy(), p))
    assert len(got) == len(want) == 10
    for (a, b, c), (d, e, f) in zip(want, got):
        assert c == f, "the same order"
        assert np.array_equal(a, d) and np.array_equal(b, e)
    assert dev.stats()["stages"]["upload"]["items_out"] == 10


def test_the_consumers_stream_waits_for_the_copy_and_the_free_waits_for_the_stream(data):
    dev, _ = loader(data, device="simulated", return_paths=False)
    stream = 0x7F00
    ids = 0
    for x, y in dev:
        x.__dlpack__(stream=stream)  # a consumer on its own stream (the capsule is dropped)
        np.from_dlpack(y)  # a CPU consumer names no stream: DLPack's legacy default (1)
        with pytest.raises(ValueError, match="DLPack names CUDA streams"):
            x.__dlpack__(stream=0)
        ids += 2
        del x, y
    gc.collect()
    log = dev._native._device_log()
    copies = [r for r in log if r[0] == "copy"]
    assert len(copies) == ids == 20, "images and labels, each batch"
    waits = {r[1]: r[2] for r in log if r[0] == "stream_wait"}
    assert sorted(set(waits.values())) == [1, stream]
    assert len(waits) == ids, "each exported tensor made its consumer's stream wait"
    for r in log:
        if r[0] == "host_wait":
            # Only the uploader's staging ring may block on a copy, never the consumer.
            assert r[2] and r[2].startswith("fg-upload"), r
    frees = {r[1]: r[3] for r in log if r[0] == "free"}
    assert len(frees) == ids, "every batch freed"
    for i, streams in frees.items():
        assert streams == [waits[i]], f"copy {i} was freed after its consumer's stream"
    assert dev._native._device_bytes()[0] == 0


def test_device_bytes_waiting_for_a_slow_consumer_stay_within_device_memory_mb(data):
    batch = 4 * 3 * 32 * 32 + 4 * 8  # images + int64 labels

    def peak(mb):
        dev, _ = loader(data, device="simulated", return_paths=False, device_memory_mb=mb)
        for x, y in dev:
            time.sleep(0.05)  # a slow training step
            del x, y
        gc.collect()
        return dev._native._device_bytes()[1]

    bounded = peak(batch / 1048576)
    # The budget (1 batch), the one the upload worker holds while the buffer is full and the
    # one the consumer holds.
    assert bounded <= 3 * batch, bounded
    # Without the budget more piles up (the loader's buffer of two, the upload worker's, the
    # consumer's): the bound above binds.
    assert peak(64) > 3 * batch, "without the budget more piles up: the bound above binds"


def test_device_arguments_are_checked(data):
    with pytest.raises(ValueError, match="device must be"):
        loader(data, device="gpu")
    with pytest.raises(ValueError, match="cuda:0"):
        loader(data, device="cuda:first")
    with pytest.raises(ValueError, match="device_memory_mb"):
        loader(data, device="simulated", device_memory_mb=0)
    # A device budget below one batch (it let one batch through at a time, over the budget).
    with pytest.raises(ValueError, match=r"a device budget of 0\.0 MiB cannot hold one batch"):
        loader(data, device="simulated", device_memory_mb=0.001)
    # A number as a pipeline file's `device.memory_mb` is (True was taken as 1 MiB).
    for bad, says in ((True, "invalid type: boolean `true`, expected a number"),
                      ("64", 'invalid type: string "64", expected a number')):
        with pytest.raises(ValueError, match="^device_memory_mb: " + says):
            loader(data, device="simulated", device_memory_mb=bad)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_cuda_without_a_driver_raises_device_unavailable_at_construction(data):
    assert shutil.which("nvidia-smi") is None, "a GPU machine: run with FLOWGATE_REQUIRE_GPU=1"
    with pytest.raises(flowgate.DeviceUnavailable, match="libcuda|driver|cuda"):
        loader(data, device="cuda")
    assert issubclass(flowgate.DeviceUnavailable, RuntimeError)
    # The CPU path is unchanged.
    cpu, _ = loader(data)
    assert sum(len(x) for x, _, _ in cpu) == 40


def test_a_device_loader_refuses_dataloader_workers(data):
    torch = pytest.importorskip("torch")
    dev, _ = loader(data, device="simulated", return_paths=False)
    dl = torch.utils.data.DataLoader(dev, batch_size=None, num_workers=2)
    with pytest.raises(Exception, match="uploads from the training process"):
        next(iter(dl))


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (FLOWGATE_REQUIRE_GPU=1)")
def test_cuda_batches_are_cuda_tensors_on_the_current_stream(data):
    torch = pytest.importorskip("torch")
    cpu, _ = loader(data, return_paths=False)
    dev, _ = loader(data, device="cuda", return_paths=False, output="torch")
    want = [(x.clone(), y.clone()) for x, y in (
        (torch.from_dlpack(a), torch.from_dlpack(b)) for a, b in cpu)]
    side = torch.cuda.Stream()
    n = 0
    with torch.cuda.stream(side):
        for (x, y), (wx, wy) in zip(dev, want):
            assert x.is_cuda and y.is_cuda
            s = (x.float().sum() + y.sum()).item()  # queued on `side`, after the copy
            assert s == wx.float().sum().item() + wy.sum().item()
            n += 1
    assert n == len(want)
