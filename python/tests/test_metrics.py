"""A loader's Prometheus endpoint (``metrics_port=``): the library's renderer and its reading
of an address, served from the training process only."""

import os
import time

import pytest

import flowgate


def test_metrics_port_serves_prometheus_series_with_the_ranks_labels(data, monkeypatch):
    """``metrics_port=0``: the library's Prometheus renderer (``flowgate run``'s series) on a
    free loopback port, every series labelled with torchrun's RANK and LOCAL_RANK; a copy does
    not serve; ``close()`` stops it; a taken port and a bad value are errors naming them."""
    import pickle
    import urllib.error
    import urllib.request

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")  # rank 3 of 4: 10 images, 3 batches
    loader = flowgate.ImageLoader(str(data / "images.txt"), batch_size=4, crop=32, resize=32,
                                  metrics_port=0)
    host, port = loader.metrics_address
    assert host == "127.0.0.1" and port > 0
    it = iter(loader)
    for _ in range(3):
        next(it)
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    labels = 'rank="3",local_rank="1"'
    delivered = [line for line in body.splitlines()
                 if line.startswith("flowgate_delivered_total{")]
    assert delivered and labels in delivered[0] and float(delivered[0].split()[-1]) >= 2, body
    for name in ("flowgate_stage_workers", "flowgate_stage_queue_bytes",
                 "flowgate_memory_budget_bytes", "flowgate_held_bytes"):
        assert any(line.startswith(name + "{") and labels in line
                   for line in body.splitlines()), (name, body)
    assert '# TYPE flowgate_delivered_total counter' in body
    assert 'stage="decode"' in body
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.metrics_address is None, "a copy does not take the port"
    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        flowgate.ImageLoader(str(data / "images.txt"), metrics_port=port)
    for bad in (-1, 70000, "host:", True, 1.5):
        with pytest.raises(ValueError, match="metrics_port"):
            flowgate.ImageLoader(str(data / "images.txt"), metrics_port=bad)
    # A forked child (a DataLoader worker) neither serves nor holds the port: closed in the
    # parent, it is free although the child lives on.
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        os.write(w, repr(loader.metrics_address).encode())
        time.sleep(3)
        os._exit(0)
    os.close(w)
    assert os.read(r, 100) == b"None", "the child does not serve"
    # A client that connects and sends nothing delays neither a scrape nor close().
    import socket
    idle = socket.create_connection((host, port))
    t = time.monotonic()
    urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read()
    del it
    loader.close()
    assert time.monotonic() - t < 1.5, time.monotonic() - t
    assert loader.metrics_address is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2)
    again = flowgate.ImageLoader(str(data / "images.txt"), metrics_port=port)  # port freed
    assert again.metrics_address == (host, port)
    again.close()
    idle.close()
    os.waitpid(child, 0)
    # IPv6 and host names, as "host:port".
    if socket.has_ipv6:
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
        except OSError:
            pass
        else:
            six = flowgate.ImageLoader(str(data / "images.txt"), metrics_port="[::1]:0")
            assert six.metrics_address[0] == "::1"
            six.close()
    named = flowgate.ImageLoader(str(data / "images.txt"), metrics_port="localhost:0")
    assert named.metrics_address is not None
    named.close()
