"""Remote decode on Ray actors (``remote=flowgate.Ray(...)``), against a real local Ray
runtime started here: the same batches as the local loader for the same seed at any pool
size (a skipped file and ``drop_last`` too), every item once per epoch with an actor killed
mid-epoch, checkpoints that resume locally and remotely (and merged across ranks, taken at
an epoch's last batch, after a ``break``), ``set_epoch`` abandoning an epoch, actors Ray
cannot place, the pool growing while the loop waits, and clear errors (no ``ray``, a loader
the actors cannot build, a bad file with ``skip_errors=False``, bad arguments)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import flowgate

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray runtime: 6 logical CPUs (actors reserve 1 each here), a small object
    store; stopped after the module."""
    ray.init(num_cpus=6, object_store_memory=256 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def images(data: pathlib.Path) -> str:
    return str(data / "images.txt")


def loader(data, remote=None, **kw):
    """40 images in batches of 6 (the last of 4), random crops: batches, crops and order all
    follow from the seed, so two loaders agree only if they decode the same units alike."""
    args = dict(batch_size=6, resize=32, crop=24, train=True, seed=3, return_paths=True,
                output="numpy")
    args.update(kw)
    return flowgate.ImageLoader(images(data), remote=remote, **args)


def epoch(l, limit=None):
    out = []
    for b, paths in l:
        out.append((np.array(b), list(paths)))
        if limit is not None and len(out) == limit:
            break
    return out


def same(got, want):
    assert [p for _, p in got] == [p for _, p in want]
    for (a, _), (b, _) in zip(got, want):
        np.testing.assert_array_equal(a, b)


def remote(**kw):
    kw.setdefault("cpus_per_worker", 1)
    return flowgate.Ray(**kw)


def test_remote_batches_are_the_local_loaders_at_any_pool_size(cluster, data):
    local = loader(data)
    want = [epoch(local), epoch(local)]
    assert [p for _, p in want[0]] != [p for _, p in want[1]]
    for r in (remote(workers=1, local=False), remote(workers=2, local=False),
              remote(workers=2, local=True, batches_per_unit=3), remote(workers=0)):
        with loader(data, r) as l:
            assert len(l) == 7
            for e in range(2):
                same(epoch(l), want[e])
            assert l.state_dict()["epoch"] == 2


def test_every_output_type_arrives_remotely(cluster, data):
    want = epoch(loader(data))
    torch = pytest.importorskip("torch")
    for output, kind in (("torch", torch.Tensor), ("batch", flowgate.Batch)):
        with loader(data, remote(workers=1, local=False), output=output) as l:
            got = []
            for b, paths in l:
                assert isinstance(b, kind)
                got.append((np.asarray(b) if output == "batch" else b.numpy(), paths))
            same(got, want)


def actor_pids(l):
    return [ray.get(a.pid.remote()) for a in l._pool.actors.values()]


def test_an_actor_killed_mid_epoch_loses_nothing_and_repeats_nothing(cluster, data):
    want = epoch(loader(data))
    with loader(data, remote(workers=2, local=False, batches_per_unit=1)) as l:
        got = []
        it = iter(l)
        killed = False
        for b, paths in it:
            got.append((np.array(b), list(paths)))
            if killed:
                continue
            # Freeze an actor holding units; kill it (as the OOM killer would) if one of them
            # is not decoded yet, so that unit is lost with it; else let it go on.
            pool = l._pool
            for w in sorted({w for w, _ in pool.dispatch.in_hand() if w != 0}):
                # Its pid as it answered first (a call now would queue behind its units).
                pid = ray.get(pool.answers[w])
                os.kill(pid, signal.SIGSTOP)
                pending = [ref for (v, _), ref in pool.refs.items()
                           if v == w and not ray.wait([ref], timeout=0)[0]]
                if pending:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                else:
                    os.kill(pid, signal.SIGCONT)
                break
        assert killed, "no actor was caught with a unit in hand"
        same(got, want)
        assert l.stats()["remote"]["reissued_units"] >= 1
        died = [d for r in l.tuner_trace() for d in r["decisions"] if "died" in d]
        assert died, l.tuner_trace()
        # The next epoch runs on the replacement.
        assert l._pool.dispatch.workers == 2 and len(l._pool.actors) == 2
        assert len(epoch(l)) == 7


def test_a_remote_checkpoint_resumes_locally_and_a_local_one_remotely(cluster, data):
    want = epoch(loader(data))
    # Remote → local, mid-unit (units of 2 batches: 3 batches is one and a half).
    with loader(data, remote(workers=2, local=False)) as l:
        head = epoch(l, limit=3)
        state = l.state_dict()
    assert state["delivered_items"] == 18
    local = loader(data)
    local.load_state_dict(state)
    same(head + epoch(local), want)
    # Local → remote.
    local = loader(data)
    head = epoch(local, limit=2)
    state = local.state_dict()
    with loader(data, remote(workers=1, local=True)) as l:
        l.load_state_dict(state)
        same(head + epoch(l), want)
        # And the epoch after continues remotely from its start.
        assert l.state_dict()["epoch"] == 1 and l.state_dict()["delivered_items"] == 0


def test_ranks_states_merged_resume_remotely_at_another_world_size(cluster, data):
    # Two ranks take one batch each remotely (40 items: 20 each, not a multiple of 6).
    seen, states = [], []
    for rank in range(2):
        with loader(data, remote(workers=1, local=False), rank=rank, world_size=2) as l:
            for b, paths in epoch(l, limit=1):
                seen += paths
            states.append(l.state_dict())
    merged = flowgate.merge_state_dicts(states)
    with loader(data, remote(workers=2, local=False)) as l:
        l.load_state_dict(merged)
        rest = [p for _, paths in epoch(l) for p in paths]
    everything = [p for _, paths in epoch(loader(data)) for p in paths]
    assert sorted(seen + rest) == sorted(everything)
    assert len(set(seen + rest)) == 40


def test_a_break_keeps_what_was_delivered_and_the_epoch_starts_again(cluster, data):
    local = loader(data)
    want = [epoch(local), epoch(local)]
    for r in (remote(workers=1, local=False), remote(workers=2, local=False, batches_per_unit=3),
              remote(workers=1, local=True, batches_per_unit=3)):
        with loader(data, r) as l:
            epoch(l, limit=1)
            state = l.state_dict()
            assert state["epoch"] == 0 and state["delivered_items"] == 6
            # The next iteration starts epoch 0 again, whole, as a local loader's: none of
            # the abandoned run's units in hand leak into it; then epoch 1.
            same(epoch(l), want[0])
            same(epoch(l), want[1])
        resumed = loader(data)
        resumed.load_state_dict(state)
        same(want[0][:1] + epoch(resumed), want[0])
        # A resume after a break, on the same remote loader.
        with loader(data, r) as l:
            epoch(l, limit=4)
            l.load_state_dict(state)
            same(epoch(l), want[0][1:])


def test_a_state_at_an_epochs_last_batch_is_the_local_loaders(cluster, data):
    local = loader(data)
    for _ in local:
        want = local.state_dict()
    assert (want["epoch"], want["delivered_items"]) == (0, 40)
    with loader(data, remote(workers=2, local=True)) as l:
        for _ in l:
            got = l.state_dict()
        assert got == want
        assert l.state_dict()["epoch"] == 1 and l.state_dict()["delivered_items"] == 0


def test_set_epoch_mid_epoch_abandons_it_as_locally(cluster, data):
    with loader(data, remote(workers=2, local=False, batches_per_unit=1)) as l:
        it = iter(l)
        next(it)
        l.set_epoch(3)
        assert list(it) == []
        state = l.state_dict()
        assert (state["epoch"], state["delivered_items"]) == (3, 0)
        # Epoch 3 left after two batches: started again from its beginning, with a warning.
        it = iter(l)
        next(it), next(it)
        del it
        local = loader(data)
        local.set_epoch(3)
        with pytest.warns(UserWarning, match="epoch 3 starts again.*after 2 batches"):
            same(epoch(l), epoch(local))


def test_a_pinned_pool_ray_cannot_place_is_an_error_naming_the_cpus(cluster, data):
    # An actor larger than any node: refused at once, never a silent local run.
    # So is "auto" with local=False: nothing else would decode.
    for workers, local in ((1, True), (1, False), ("auto", False)):
        with loader(data, remote(workers=workers, local=local, cpus_per_worker=100)) as l:
            with pytest.raises(RuntimeError, match="needs 100 CPUs.*largest node has 6"):
                epoch(l)
    # More pinned actors than the CPUs free: the CPUs needed and free.
    with loader(data, remote(workers=8, local=False, batches_per_unit=1)) as l:
        with pytest.raises(RuntimeError, match=r"need 8 CPUs and the cluster has \d+ free"):
            epoch(l)
    # A pinned pool of all the CPUs, closed, and another at once: Ray gives the killed
    # actors' CPUs back a little later, which the new pool waits for (refused before).
    for _ in range(2):
        with loader(data, remote(workers=2, local=False, cpus_per_worker=3,
                                 batches_per_unit=4)) as l:
            assert epoch(l)
    # "auto" with actors too large for any node says so on the log and decodes locally.
    want = epoch(loader(data))
    with loader(data, remote(workers="auto", cpus_per_worker=100)) as l:
        same(epoch(l), want)
        assert l.stats()["remote"]["started"] == 0


def test_auto_says_how_many_actors_it_starts_and_fits_the_node(cluster, data, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="flowgate.remote"):
        with loader(data, flowgate.Ray(workers="auto", min_workers=1)) as l:
            epoch(l)
            # The default cpus_per_worker fits this 6-CPU runtime's node (at most 4).
            assert l._pool.cpus == 4
    lines = [r.getMessage() for r in caplog.records if r.name == "flowgate.remote"]
    assert len(lines) == 1 and "1 worker(s) at the start (min_workers=1" in lines[0], lines


def test_a_rank_named_by_the_environment_decodes_its_share_on_the_actors(cluster, data,
                                                                        monkeypatch):
    """RANK/WORLD_SIZE (torchrun's), not arguments: the actors' loaders are built at the rank
    the training process's loader resolved (its native side's), so a unit is its share's."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    want = epoch(loader(data))
    with loader(data, remote(workers=1, local=False, batches_per_unit=1)) as l:
        got = epoch(l)
        assert l.stats()["remote"]["units_by_actors"] == len(want) >= 2
    same(got, want)
    alone = [p for _, ps in epoch(loader(data, rank=0, world_size=1)) for p in ps]
    assert len([p for _, ps in got for p in ps]) < len(alone)


def test_units_are_decoded_by_the_actors_they_are_handed_to(cluster, data):
    """With local=False every unit is decoded by an actor (counted), and the batches are the
    local loader's."""
    want = epoch(loader(data))
    with loader(data, remote(workers=2, local=False, batches_per_unit=1)) as l:
        same(epoch(l), want)
        s = l.stats()["remote"]
        assert s["units_by_actors"] == len(want) and s["units_local"] == 0, s


def test_relative_paths_are_read_from_the_training_processs_directory(
        cluster, data, monkeypatch):
    """Actors start where Ray started its workers: a relative listing is the training
    process's, so they read it from there."""
    monkeypatch.chdir(data)
    args = dict(batch_size=6, resize=32, crop=24, train=True, seed=3, output="numpy")
    want = [np.array(b) for b in flowgate.ImageLoader("images.txt", **args)]
    with flowgate.ImageLoader("images.txt", remote=remote(workers=2, local=False),
                              **args) as l:
        got = [np.array(b) for b in l]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_loader_the_actors_cannot_build_is_an_error_naming_why(cluster, data, tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(open(images(data)).read())
    l = flowgate.ImageLoader(str(listing), batch_size=6, resize=32, crop=24, output="numpy",
                             remote=remote(workers=1, local=False))
    listing.unlink()
    with pytest.raises(RuntimeError, match="list.txt"):
        epoch_len = sum(1 for _ in l)
        assert epoch_len < 0
    # The error left the pool short: the next iter() starts it again (a KeyError before).
    listing.write_text(open(images(data)).read())
    assert sum(1 for _ in l) == 7
    assert l._pool.dispatch.workers == 1
    l.close()


def test_the_pool_grows_while_the_loop_waits_and_says_why(cluster, data):
    r = remote(workers="auto", min_workers=1, max_workers=3, local=False, batches_per_unit=1)
    with loader(data, r, resize=96, crop=80) as l:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            epoch(l)
            if l._pool.dispatch.workers >= 2 and len(l.tuner_trace()) >= 3:
                break
        trace = l.tuner_trace()
        grew = [d for rec in trace for d in rec["decisions"] if "one more worker" in d]
        assert grew, trace
        assert "RemoteWorkers(1 -> 2)" in grew[0]
        assert max(rec["workers"] for rec in trace) >= 2
        assert all(rec["workers"] <= 3 for rec in trace)
        assert all(0.0 <= rec.get("wait", 0.0) <= 1.0 for rec in trace)


def test_actors_show_their_class_in_the_process_list(cluster, data):
    with loader(data, remote(workers=1, local=False)) as l:
        epoch(l)
        (pid,) = actor_pids(l)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode()
        assert "FlowgateDecoder" in cmdline


def test_a_skipped_file_gives_the_local_loaders_batches(cluster, data, tmp_path):
    files = [str(p) for p in sorted((data / "images").rglob("*.jpg"))][:13]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    files.insert(4, str(bad))
    for drop_last in (False, True):
        kw = dict(batch_size=3, resize=32, crop=24, shuffle=False, drop_last=drop_last,
                  return_paths=True, output="numpy")
        want = epoch(flowgate.ImageLoader(files, **kw))
        assert [len(p) for _, p in want] == [3, 3, 3, 3] + ([] if drop_last else [1])
        for r in (remote(workers=1, local=False, batches_per_unit=1),
                  remote(workers=2, local=True)):
            with flowgate.ImageLoader(files, remote=r, **kw) as l:
                same(epoch(l), want)
                assert [f[1] for f in l.failures()] == [str(bad)]
                # The epoch run again adds its failure to the first run's, as locally.
                l.set_epoch(0)
                same(epoch(l), want)
                assert [f[1] for f in l.failures(0)] == [str(bad)] * 2


def test_ranks_make_up_the_batches_a_skipped_file_cost_as_the_local_loader(
        cluster, data, tmp_path):
    """Under a world of ranks (fill_skipped on by default), the rank whose share holds an
    unreadable file makes up the batch it cost after its units, as the local loader does:
    every rank yields len(loader) batches (DDP never waits on a rank that ended early), the
    same batches, and a state_dict taken before the made-up batch resumes it."""
    files = [str(p) for p in sorted((data / "images").rglob("*.jpg"))][:13]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    files.insert(4, str(bad))
    kw = dict(batch_size=3, resize=32, crop=24, seed=5, world_size=2, return_paths=True,
              output="numpy")
    filled = []
    for rank in (0, 1):
        local = flowgate.ImageLoader(files, rank=rank, **kw)
        want = epoch(local)
        assert len(want) == len(local) == 3
        with flowgate.ImageLoader(files, rank=rank, remote=remote(workers=1, local=False,
                                                                  batches_per_unit=1),
                                  **kw) as l:
            assert len(l) == len(local)
            it = iter(l)
            got = [next(it) for _ in range(len(want) - 1)]
            state = l.state_dict()
            got += list(it)
            same([(np.array(b), list(p)) for b, p in got], want)
            filled.append(l.stats()["filled"])
            if filled[-1]:
                assert state["owed_batches"] == 1, state
                with flowgate.ImageLoader(files, rank=rank, remote=remote(
                        workers=1, local=False, batches_per_unit=1), **kw) as again:
                    again.load_state_dict(state)
                    same(epoch(again), want[-1:])
    assert sorted(f > 0 for f in filled) == [False, True], filled


def test_a_unit_of_only_unreadable_files_is_skipped_and_an_all_bad_epoch_is_an_error(
        cluster, data, tmp_path):
    files = [str(p) for p in sorted((data / "images").rglob("*.jpg"))][:10]
    bad = []
    for i in range(3):
        b = tmp_path / f"bad{i}.jpg"
        b.write_bytes(b"not a jpeg")
        bad.append(str(b))
    # The second batch (a unit of its own) all unreadable.
    files = files[:3] + bad + files[3:]
    kw = dict(batch_size=3, resize=32, crop=24, shuffle=False, return_paths=True,
              output="numpy")
    want = epoch(flowgate.ImageLoader(files, **kw))
    for r in (remote(workers=1, local=False, batches_per_unit=1), remote(workers=0)):
        with flowgate.ImageLoader(files, remote=r, **kw) as l:
            same(epoch(l), want)
            assert sorted(f[1] for f in l.failures()) == bad
    # Every file unreadable: the same error as the local loader's, not an empty epoch.
    for r in (None, remote(workers=1, local=False, batches_per_unit=1)):
        with flowgate.ImageLoader(bad, remote=r, **kw) as l:
            with pytest.raises(flowgate.LoaderError, match="delivered nothing"):
                epoch(l)


def test_a_bad_file_with_skip_errors_off_raises_in_the_training_loop(cluster, data, tmp_path):
    files = [str(p) for p in sorted((data / "images").rglob("*.jpg"))][:10]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    files.insert(4, str(bad))
    l = flowgate.ImageLoader(files, batch_size=3, resize=32, crop=24, shuffle=False,
                             skip_errors=False, output="numpy",
                             remote=remote(workers=1, local=False))
    with pytest.raises(flowgate.LoaderError, match="bad.jpg"):
        for _ in l:
            pass
    # The error ended the epoch, as locally: the next is epoch 1, from its start.
    assert l.epoch == 1 and l.state_dict()["delivered_items"] == 0
    l.close()


def test_bad_remote_arguments_are_refused(data):
    with pytest.raises(TypeError, match="flowgate.Ray"):
        flowgate.ImageLoader(images(data), remote="ray")
    with pytest.raises(ValueError, match="workers"):
        flowgate.Ray(workers=0, local=False)
    with pytest.raises(ValueError, match="min_workers"):
        flowgate.Ray(min_workers=5, max_workers=2)
    with pytest.raises(ValueError, match="cpus_per_worker"):
        flowgate.Ray(cpus_per_worker=0)
    with pytest.raises(ValueError, match="cpus_per_worker"):
        flowgate.Ray(cpus_per_worker=float("inf"))
    with pytest.raises(ValueError, match="local: invalid type"):
        flowgate.Ray(local="no")
    with pytest.raises(ValueError, match="max_workers"):
        flowgate.Ray(workers=5, max_workers=2)
    with pytest.raises(ValueError, match="pinned"):
        flowgate.Ray(workers=2, min_workers=3, max_workers=4)
    with pytest.raises(TypeError, match="address"):
        flowgate.Ray(address=123)
    with pytest.raises(ValueError, match="remote decoding: units decoded elsewhere arrive in host"):
        flowgate.ImageLoader(images(data), device="simulated", remote=flowgate.Ray())
    # A device name that is none is that error first (it used to say "remote").
    for bad in ("tpu", "CPU"):
        with pytest.raises(ValueError, match="device must be"):
            flowgate.ImageLoader(images(data), device=bad, remote=flowgate.Ray())
    # The library's rules and words (`flowgate::loader::PoolSettings`, tested in Rust): one
    # translation check per kind of refusal.
    for kw, says in (
            (dict(max_workers=5000), "max_workers: must be in 1..=4096, not 5000"),
            (dict(workers=True),
             'workers: invalid type: boolean `true`, expected "auto" or a whole number, at least 0'),
            (dict(workers="all"),
             'workers: invalid value: string "all", expected "auto" or a whole number, at least 0'),
            (dict(batches_per_unit=0), "batches_per_unit: must be in 1..=1024, not 0"),
            (dict(start_timeout=float("nan")), "start_timeout: must be in (0, 86400], not NaN"),
            (dict(cpus_per_worker=float("inf")), "cpus_per_worker: must be in [0.01, 4096], not inf"),
            (dict(cpus_per_worker=1e-5), "cpus_per_worker: must be in [0.01, 4096], not 0.00001")):
        with pytest.raises(ValueError) as e:
            flowgate.Ray(**kw)
        assert str(e.value) == says, (kw, str(e.value))
    # Resolved by the library, and kept across pickling (a loader's arguments are pickled).
    import pickle
    r = flowgate.Ray(local=False, max_workers=3)
    assert (r.workers, r.min_workers, r.max_workers, r.cpus_per_worker) == ("auto", 1, 3, None)
    back = pickle.loads(pickle.dumps(r))
    assert repr(back) == repr(r) and back.start_timeout == r.start_timeout == 300.0


def test_without_ray_the_error_names_the_package(data):
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import flowgate\n"
        f"l = flowgate.ImageLoader({images(data)!r}, remote=flowgate.Ray())\n"
        "try:\n"
        "    iter(l)\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert "ERR" in out.stdout and "pip install ray" in out.stdout, out.stdout + out.stderr


def test_every_kind_of_source_is_decoded_by_actors_alike(cluster, data, videos, tmp_path):
    """Video, audio, tar shards and a mixture of shards and Parquet: with local=False every
    unit is decoded by an actor (counted), and the batches are the local loader's."""
    from test_shards import paths_of, write_shards
    r = remote(workers=2, local=False, batches_per_unit=1)
    shards = flowgate.Shards(write_shards(paths_of(data), tmp_path / "shards"), buffer=8)
    makes = {
        "video": lambda remote: flowgate.VideoLoader(
            str(videos / "video.txt"), batch_size=3, frames=4, resize=32, crop=24, train=True,
            stride=2, seed=1, audio_seconds=0.5, return_paths=True, output="numpy",
            remote=remote),
        "audio": lambda remote: flowgate.AudioLoader(
            str(data / "audio.txt"), batch_size=3, seconds=1.0, train=True,
            return_lengths=True, return_paths=True, output="numpy", remote=remote),
        "shards": lambda remote: flowgate.ImageLoader(
            shards, labels="cls", batch_size=6, resize=32, crop=24, train=True, seed=2,
            return_paths=True, output="numpy", remote=remote),
    }
    from test_parquet import write as write_parquet  # pyarrow: installed by the test command
    rows = flowgate.Parquet(write_parquet(paths_of(data), tmp_path / "t.parquet"), buffer=8)
    mix = flowgate.Mix([shards, rows], weights=[0.5, 0.5], draws=30, labels=["cls", "label"])
    makes["mixture"] = lambda remote: flowgate.ImageLoader(
        mix, batch_size=4, resize=32, crop=24, seed=5, return_paths=True, output="numpy",
        remote=remote)
    for kind, make in makes.items():
        want = [tuple(np.array(x) if not isinstance(x, list) else x for x in b)
                for b in make(None)]
        with make(r) as l:
            got = [tuple(np.array(x) if not isinstance(x, list) else x for x in b) for b in l]
            s = l.stats()["remote"]
        assert s["units_by_actors"] == len(want) and s["units_local"] == 0, (kind, s)
        assert len(got) == len(want), kind
        for g, w in zip(got, want):
            assert g[-1] == w[-1], kind
            for a, b in zip(g[:-1], w[:-1]):
                np.testing.assert_array_equal(a, b)
