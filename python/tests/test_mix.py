"""flowgate.Mix: tar shards and a Parquet file drawn by weight through one loader, each
source's labels from its own field, the same pixels as the sources alone, epochs that end
as asked, exact resume, and bad arguments named."""

import numpy as np
import pytest

import flowgate
from test_shards import paths_of, write_shards

pytest.importorskip("pyarrow")
from test_parquet import write as write_parquet  # noqa: E402

ARGS = dict(batch_size=4, crop=32, resize=32, seed=9, workers=1)


def sources(data, tmp_path):
    paths = paths_of(data)
    shards = flowgate.Shards(write_shards(paths, tmp_path / "shards"), buffer=8)  # cls = 3 * i
    rows = flowgate.Parquet(write_parquet(paths, tmp_path / "t.parquet"), buffer=8)  # 7 * i
    return shards, rows


def labels_of(loader):
    return [int(x) for _, lab in loader for x in np.asarray(lab)]


def test_a_mixture_draws_by_weight_with_each_sources_labels(data, tmp_path):
    shards, rows = sources(data, tmp_path)
    mix = flowgate.Mix([shards, rows], weights=[0.75, 0.25], draws=2000, labels=["cls", "label"])
    got = labels_of(flowgate.ImageLoader(mix, **dict(ARGS, batch_size=40, crop=8, resize=8)))
    assert len(got) == 2000
    # Labels that only one source has: 34 of the shards' 40 (3i, not a multiple of 7) and 26
    # of the rows' 40 (7i, not a multiple of 3). Sources cycle in whole passes, so each
    # source's draws are about its count of those over its share of them.
    shard_draws = sum(1 for v in got if v % 3 == 0 and v % 7 != 0) / (34 / 40)
    row_draws = sum(1 for v in got if v % 7 == 0 and v % 3 != 0) / (26 / 40)
    share = shard_draws / (shard_draws + row_draws)
    assert 0.70 < share < 0.80, (shard_draws, row_draws)
    # Each label's pixels are its source's: a mixed image equals the same sample alone.
    alone = {}
    for src, field in ((shards, "cls"), (rows, "label")):
        for images, labs in flowgate.ImageLoader(src, labels=field, shuffle=False, **ARGS):
            for img, lab in zip(np.asarray(images), np.asarray(labs)):
                alone.setdefault(int(lab), []).append(img.copy())
    mix = flowgate.Mix([shards, rows], weights=[0.75, 0.25], draws=100, labels=["cls", "label"])
    for images, labs in flowgate.ImageLoader(mix, **ARGS):
        for img, lab in zip(np.asarray(images), np.asarray(labs)):
            assert any(np.array_equal(img, a) for a in alone[int(lab)]), int(lab)


def test_stop_first_and_all_and_exact_resume(data, tmp_path):
    shards, rows = sources(data, tmp_path)
    want = {3 * i for i in range(40)} | {7 * i for i in range(40)}
    every = labels_of(flowgate.ImageLoader(
        flowgate.Mix([shards, rows], [0.5, 0.5], stop="all", labels=["cls", "label"]), **ARGS))
    assert set(every) == want and len(every) >= 80
    first = labels_of(flowgate.ImageLoader(
        flowgate.Mix([shards, rows], [0.5, 0.5], stop="first", labels=["cls", "label"]), **ARGS))
    assert 40 <= len(first) <= 80 and set(first) <= want

    mix = flowgate.Mix([shards, rows], [0.6, 0.4], draws=120, labels=["cls", "label"])
    whole = labels_of(flowgate.ImageLoader(mix, **ARGS))
    a = flowgate.ImageLoader(mix, **ARGS)
    it = iter(a)
    head = [int(x) for _ in range(5) for x in np.asarray(next(it)[1])]
    state = a.state_dict()
    b = flowgate.ImageLoader(mix, **ARGS)
    b.load_state_dict(state)
    # The loader yields batches as they finish, so compare the draws, not their order.
    assert sorted(head + labels_of(b)) == sorted(whole)


def test_bad_mixtures_are_named(data, tmp_path):
    shards, rows = sources(data, tmp_path)
    with pytest.raises(ValueError, match="2 sources, 1 weights"):
        flowgate.Mix([shards, rows], [1.0])
    with pytest.raises(ValueError, match="sources\\[1\\] must be"):
        flowgate.Mix([shards, "list.txt"], [1.0, 1.0])
    with pytest.raises(ValueError, match='^Mix: stop: must be "first" or "all", not "never"$'):
        flowgate.Mix([shards], [1.0], stop="never")
    # The library's rules (`flowgate::sampler::check_weights`, a pipeline file's too), at
    # construction: before, NaN and negative weights waited for the sources to open.
    for weights, says in (([float("nan"), 1.0], r"weights\[0\] is NaN"),
                          ([1.0, -1.0], r"weights\[1\] is -1"),
                          ([0.0, 0.0], "every weight is 0"),
                          ([], "0 sources, 0 weights")):
        with pytest.raises(ValueError, match="^Mix: weights: .*" + says):
            flowgate.Mix([shards, rows][:len(weights)], weights)
    with pytest.raises(ValueError, match="draws"):
        flowgate.Mix([shards], [1.0], draws=0)
    # Weights are numbers as a pipeline file's are (float() took "1" and True before), and
    # `stop` is checked with `draws` too (it was ignored).
    for weights, says in ((["1", 2], 'invalid type: string "1", expected a number'),
                          ([True, 1], "invalid type: boolean `true`, expected a number")):
        with pytest.raises(ValueError, match="^Mix: weights: " + says):
            flowgate.Mix([shards, rows], weights)
    # Draws of any value in the library's words, the value as given (past 128 bits it was
    # shown clamped; a fraction had words of its own).
    for bad, shown in ((-1, "-1"), (4.0, "4.0"), (True, "true"), (2**200, str(2**200))):
        with pytest.raises(ValueError, match=rf"^Mix: draws: must be in 1\.\.=4294967296, not {shown}$"):
            flowgate.Mix([shards], [1.0], draws=bad)
    with pytest.raises(ValueError, match='^Mix: stop: must be "first" or "all", not "bad"$'):
        flowgate.Mix([shards], [1.0], draws=4, stop="bad")
    assert flowgate.Mix([shards, rows], [1, 2]).weights == [1.0, 2.0]
    with pytest.raises(ValueError, match="every source needs a label field, or none"):
        flowgate.ImageLoader(flowgate.Mix([shards, rows], [1, 1], labels=["cls", None]), **ARGS)
    with pytest.raises(ValueError, match="weight"):
        flowgate.ImageLoader(flowgate.Mix([shards, rows], [0.0, 0.0]), **ARGS)


def test_the_most_draws_allowed_are_refused_when_built_where_their_order_cannot_fit(data, tmp_path):
    # 2^32 draws (the limit) need a 96 GiB order at the epoch's start: it aborted the process
    # on its allocation at the first next(). Refused when the loader is built,
    # with both figures, where the machine has less (every CI machine here).
    import re
    shards, rows = sources(data, tmp_path)
    mix = flowgate.Mix([shards, rows], [1, 1], draws=2**32)
    try:
        flowgate.ImageLoader(mix, **ARGS)
    except ValueError as e:
        said = str(e)
    else:
        pytest.skip("this machine holds a 96 GiB order")
    assert re.search(r"an epoch of 4294967296 items: its order takes about 96\.0 GiB .* more "
                     r"than the [0-9.]+ GiB this process has \(", said), said
    # Its DataLoader counterpart: a dataset that long.
    class Long:
        def __len__(self):
            return 2**32

        def __getitem__(self, i):
            return i

    with pytest.raises(ValueError, match="an epoch of 4294967296 items: its order"):
        flowgate.DataLoader(Long())
