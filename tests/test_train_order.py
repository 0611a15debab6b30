"""Reproducible training data: the rows each Ray Train worker reads, and their order, depend on
the manifest's samples only, not on how Ray Data happened to write them into shards."""

from __future__ import annotations

import random
import threading

import pytest
import webdataset as wds

from pipeline.schema import KEY, encode
from preprocess import manifest as mf
from tests.support.padcap import sample
from train.data import shuffle_buffer
from train.trainer import read_train_dataset

pytestmark = pytest.mark.integration


def _write_layout(root, groups, samples):
    """Tars holding the samples in the given groups (indices, in file order) + the manifest rows."""
    root.mkdir()
    rows = []
    for g, members in enumerate(groups):
        path = str(root / f"part-{g}.tar")
        with wds.TarWriter(path) as sink:
            for i in members:
                fields = encode(samples[i])
                sink.write(fields)
                rows.append(mf.empty_row(video_id=samples[i].video_id, status="ok", split="train", shard=path,
                                         key=fields[KEY]))
    return mf.current_keys(rows, "train")


def _worker_streams(keys, world: int = 2) -> list[list[str]]:
    """The keys each of `world` workers reads in epoch 0, as Ray Train hands them out
    (streaming_split, equal, no locality) and train/trainer.RayEpochs shuffles them."""
    ds = read_train_dataset(keys)
    splits = ds.streaming_split(world, equal=True, locality_hints=None)
    out: list[list[str]] = [[] for _ in range(world)]

    def consume(rank):  # the splits must be read concurrently, as the workers do
        rng = random.Random((0 * 1_000_003 + 0) * 1009 + rank)
        out[rank] = [r[KEY] for r in shuffle_buffer(splits[rank].iter_rows(), 8, rng)]

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def test_same_samples_in_other_shard_layouts_give_each_worker_the_same_stream(ray_local, tmp_path):
    # 40 samples: 2 blocks of ROWS_PER_BLOCK=32 and 8, so the split cuts a block, as it does at scale
    samples = [sample(num_segments=6, intervals=((1.0, 3.0),), seed=i, video_id=f"v{i:02d}") for i in range(40)]
    order = list(range(40))
    random.Random(1).shuffle(order)
    a = _write_layout(tmp_path / "a", [list(range(0, 15)), list(range(15, 40))], samples)
    b = _write_layout(tmp_path / "b", [order[:9], order[9:25], order[25:]], samples)
    first, second = _worker_streams(a), _worker_streams(b)
    assert first == second
    assert sorted(first[0] + first[1]) == sorted(encode(s)[KEY] for s in samples)  # each sample once
    assert len(first[0]) == len(first[1]) == 20
