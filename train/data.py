"""Training data: shard records -> Samples fitted to the model -> padded Batches.

    records = read_shard_records(shard_paths, stats)       # local or s3:// tars, raw bytes per field
    source = InMemoryEpochs(list(records), seed=0)          # or the Ray Data shard (train/trainer.py)
    batches = Batcher(model, batch_size=2, stats=stats, generator=g)
    for batch in batches(source.epoch(0)): ...

A record is one WebDataset sample as a dict of raw bytes (`__key__`, meta.json,
times.npy, visual.npy, audio.npy), exactly what `ray.data.read_webdataset(...,
decoder=None)` hands back per row; `pipeline.schema.decode` turns it into a Sample.
A record that does not decode or validate, or that cannot become an example, is
skipped and counted in `DataStats` (with the first reasons kept), never fatal.

Samples too long for the model are shortened by its `fit` (pipeline/fitting.py, shared
with decoding). Pure python/numpy/torch; no ray.
"""

from __future__ import annotations

import random
import tarfile
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from pipeline import storage
from pipeline.examples import Batch, ExampleError
from pipeline.schema import FIELDS, KEY, Event, Sample, SchemaError, decode

MAX_REASONS = 20  # distinct skip reasons kept for the report


@dataclass
class DataStats:
    """What happened to the records one worker read."""

    records: int = 0  # records seen
    used: int = 0  # became examples
    skipped: int = 0  # corrupt / invalid / unusable records
    truncated: int = 0  # samples shortened by fit_segments
    reasons: Counter = field(default_factory=Counter)

    def skip(self, reason: str) -> None:
        self.skipped += 1
        if reason in self.reasons or len(self.reasons) < MAX_REASONS:
            self.reasons[reason] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "used": self.used, "skipped": self.skipped, "truncated": self.truncated,
                "skip_reasons": dict(self.reasons)}


# --------------------------------------------------------------------------- reading shards


def _group_tar(fileobj, url: str) -> Iterator[dict[str, Any]]:
    """Stream a tar, grouping consecutive members by key (the name before the first dot)."""
    current: dict[str, Any] | None = None
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if not member.isreg() or "." not in name:
                continue
            key, suffix = name.split(".", 1)
            data = tar.extractfile(member).read()
            if current is None or current[KEY] != key:
                if current is not None:
                    yield current
                current = {KEY: key, "__url__": url}
            current[suffix] = data
    if current is not None:
        yield current


def read_keyed_records(path: str, keys: Collection[str]) -> dict[str, dict[str, Any]]:
    """{key: raw record} of only `keys` in one tar (local or s3://): its headers are read, the
    other members' data is seeked over, so each sample's bytes are read once by whoever wants it."""
    fs, inner = storage.filesystem(path)
    wanted = set(keys)
    out: dict[str, dict[str, Any]] = {}
    with fs.open(inner, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if not member.isreg() or "." not in name:
                continue
            key, suffix = name.split(".", 1)
            if key in wanted:
                out.setdefault(key, {KEY: key, "__url__": path})[suffix] = tar.extractfile(member).read()
    return out


def read_shard_records(paths: Sequence[str], stats: DataStats | None = None,
                       keys: Mapping[str, Collection[str]] | None = None) -> Iterator[dict[str, Any]]:
    """Raw records of WebDataset tars (local paths or s3:// URIs), in file order.

    keys: {shard: keys} (`preprocess.manifest.current_keys`): only those records of each
    shard (a redone video's older sample stays in an older tar under the same key).
    A tar that is unreadable or truncated contributes the records before the damage;
    the damage is counted as one skipped record with the reason, and reading goes on.
    """
    for path in paths:
        fs, inner = storage.filesystem(path)
        wanted = None if keys is None else set(keys.get(path, ()))
        try:
            with fs.open(inner, "rb") as f:
                for record in _group_tar(f, path):
                    if wanted is None or record[KEY] in wanted:
                        yield record
        except (tarfile.TarError, OSError, EOFError) as e:
            if stats is not None:
                stats.skip(f"unreadable shard {path.rsplit('/', 1)[-1]}: {type(e).__name__}: {e}")


def decode_record(record: dict[str, Any]) -> Sample:
    """Raw record -> validated Sample; SchemaError (with the key) for anything malformed."""
    fields = {k: record[k] for k in (KEY, *FIELDS) if k in record}
    try:
        return decode({k: (bytes(v) if isinstance(v, (bytearray, memoryview, np.ndarray)) else v) for k, v in fields.items()})
    except SchemaError:
        raise
    except Exception as e:  # bad npy bytes, bad JSON, wrong types in meta
        raise SchemaError(f"record {record.get(KEY, '?')!r}: {type(e).__name__}: {e}") from None


def read_samples(paths: Sequence[str] | Mapping[str, Collection[str]], limit: int = 0,
                 stats: DataStats | None = None) -> list[Sample]:
    """Decoded samples of some shards (validation / evaluation sets); corrupt records skipped.

    paths: shard paths (every record, in file order) or {shard: keys} as
    `preprocess.manifest.current_keys` gives them: only those records, sorted by key before
    `limit` applies, so the set and its order do not depend on how the shards were written.
    """
    stats = stats if stats is not None else DataStats()
    out: list[Sample] = []
    keys = paths if isinstance(paths, Mapping) else None
    records = read_shard_records(list(paths), stats, keys)
    if keys is not None:
        records = sorted(records, key=lambda r: r[KEY])
    for rec in records:
        stats.records += 1
        try:
            out.append(decode_record(rec))
        except SchemaError as e:
            stats.skip(str(e))
        if limit and len(out) >= limit:
            break
    return out


# --------------------------------------------------------------------------- epochs and shuffling


def shuffle_buffer(items: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Streaming shuffle: fill a buffer of `size`, emit a random element per new one (size <= 1: as is)."""
    if size <= 1:
        yield from items
        return
    buf: list[Any] = []
    for item in items:
        buf.append(item)
        if len(buf) >= size:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


class InMemoryEpochs:
    """Epochs over a list of records: a seeded permutation per epoch (deterministic, so a
    resumed run sees the same batches as an uninterrupted one)."""

    def __init__(self, records: Sequence[Any], seed: int = 0):
        self.records = list(records)
        self.seed = seed

    def epoch(self, index: int) -> Iterator[Any]:
        order = list(range(len(self.records)))
        random.Random(self.seed * 1_000_003 + index).shuffle(order)
        return (self.records[i] for i in order)


# --------------------------------------------------------------------------- augmentation


def crop_cuts(times: np.ndarray, events: Sequence[Event], max_fraction: float) -> tuple[list[int], list[int]]:
    """Valid (start, end) cut indices: keep segments [c, d); no event may straddle a cut.

    start cuts c in [0, max_fraction * T], end cuts d in [T - max_fraction * T, T]; a cut
    is valid when no event has start < cut time < end (events stay whole or go whole).
    """
    t = times.shape[0]
    span = int(max_fraction * t)

    def clear(x: float) -> bool:
        return not any(e.start < x - 1e-6 and x + 1e-6 < e.end for e in events)

    starts = [c for c in range(0, min(span, t - 1) + 1) if c == 0 or clear(float(times[c, 0]))]
    ends = [d for d in range(max(t - span, 1), t + 1) if d == t or clear(float(times[d - 1, 1]))]
    return starts, ends


def random_crop(sample: Sample, max_fraction: float, rng: np.random.Generator) -> Sample:
    """A random temporal window of the video, cut only in gaps between events.

    Up to `max_fraction` of the segments go at each end; events outside the window are
    dropped (so K changes too), the rest keep their captions; times are shifted so the
    window starts at 0. Returns the sample unchanged when no window keeps an event.
    Changing absolute positions and counts keeps a small model from memorising captions
    by *when* an event happens in a training video.
    """
    if max_fraction <= 0 or sample.num_segments < 2:
        return sample
    times = sample.segment_times
    starts, ends = crop_cuts(times, sample.events, max_fraction)
    for _ in range(8):
        c, d = int(rng.choice(starts)), int(rng.choice(ends))
        if d - c < 1:
            continue
        x0, x1 = float(times[c, 0]), float(times[d - 1, 1])
        kept = [e for e in sample.events if e.start >= x0 - 1e-6 and e.end <= x1 + 1e-6]
        if not kept and sample.events:
            continue
        events = [Event(max(0.0, e.start - x0), min(x1 - x0, e.end - x0), e.caption, e.visual_caption, e.audio_caption)
                  for e in kept]
        return replace(sample, segment_times=np.ascontiguousarray(times[c:d] - x0, dtype=times.dtype),
                       visual=np.ascontiguousarray(sample.visual[c:d]), audio=np.ascontiguousarray(sample.audio[c:d]),
                       events=events, duration=x1 - x0)
    return sample


def feature_noise(sample: Sample, std: float, rng: np.random.Generator) -> Sample:
    """Gaussian noise on the visual (and real audio) features."""
    if std <= 0:
        return sample
    vis = (sample.visual.astype(np.float32) + rng.normal(0, std, sample.visual.shape)).astype(sample.visual.dtype)
    aud = sample.audio
    if sample.has_audio:
        aud = (aud.astype(np.float32) + rng.normal(0, std, aud.shape)).astype(aud.dtype)
    return replace(sample, visual=vis, audio=aud)


class Augment:
    """Training-time augmentation (`train.augment_crop`, `train.augment_noise`), drawing its
    randomness from a torch Generator (the one the loop checkpoints)."""

    def __init__(self, crop: float, noise: float, generator):
        self.crop, self.noise, self.generator = crop, noise, generator

    def __call__(self, sample: Sample) -> Sample:
        if (self.crop <= 0 and self.noise <= 0) or sample.ragged_audio:  # release-encoder samples: not augmented
            return sample
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        rng = np.random.default_rng(seed)
        return feature_noise(random_crop(sample, self.crop, rng), self.noise, rng)


# --------------------------------------------------------------------------- batches


class Batcher:
    """Records (raw dicts or Samples) -> Batches of `batch_size` examples.

    Each record is decoded, augmented (training: `augment`), fitted (the model's `fit`) and laid out by the model's
    `make_example` (with `generator`, aggregation intervals are jittered); failures are
    counted in `stats` and skipped. The last partial batch of an iterable is yielded too.
    `batch_ids`: the video ids of the batch yielded last (what the loop logs per step).
    """

    def __init__(self, model, batch_size: int, stats: DataStats | None = None, generator=None, augment=None):
        self.model = model
        self.augment = augment
        self.batch_size = batch_size
        self.stats = stats if stats is not None else DataStats()
        self.generator = generator
        self.current_id = ""  # the video id of the record `example` read last
        self.batch_ids: list[str] = []  # the video ids of the batch yielded last, in its order

    def example(self, record: Any):
        """One record -> Example, or None (counted) when it is unusable."""
        self.stats.records += 1
        try:
            sample = record if isinstance(record, Sample) else decode_record(record)
            self.current_id = sample.video_id
            if self.augment is not None:
                sample = self.augment(sample)
            sample, cut = self.model.fit(sample)  # each family fits its own way
            ex = self.model.make_example(sample, generator=self.generator)
        except (SchemaError, ExampleError, ValueError) as e:
            self.stats.skip(str(e)[:300])
            return None
        self.stats.truncated += int(cut)
        self.stats.used += 1
        return ex

    def __call__(self, records: Iterable[Any]) -> Iterator[Batch]:
        pending, ids = [], []
        for rec in records:
            ex = self.example(rec)
            if ex is None:
                continue
            pending.append(ex)
            ids.append(self.current_id)
            if len(pending) == self.batch_size:
                self.batch_ids = ids
                yield self.model.collate(pending)  # each family its own batches
                pending, ids = [], []
        if pending:
            self.batch_ids = ids
            yield self.model.collate(pending)
