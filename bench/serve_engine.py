"""The engine the serving tests use, and the synthetic videos they caption.

    corpus = synthetic_videos(tmp_dir)         # real mp4s from preprocess.synthetic (2 videos, ~8-10 s)
    factory, card, cfg = tiny_engine(cfg)      # infer.loading: tiny PadCaptioner, random init, seeded
    direct = direct_caption(factory, cfg, path)  # CaptionEngine called directly on the featurized video

    class Recorder(StandInEngine):              # a stand-in engine: only `decode` to write
        def decode(self, samples): return [f(s) for s in samples]

StandInEngine offers the serving interface of infer.engine.core.CaptionEngine (`run(feed, emit)`,
`result(sample, decoded)`), so infer/serving/engine_loop.py drives a stand-in exactly as it drives the
real engine: the tests exercise production's one engine-driving path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pipeline.config import Config, SyntheticConfig


class StandInEngine:
    """A test engine with CaptionEngine's serving interface; subclasses write `decode(samples) -> results`.

    `run(feed, emit)` polls `feed` until it has nothing (or `max_batch_videos` are taken), drops the
    cancelled requests, decodes the rest in one `decode` call, emits each result, and polls again; it
    returns when the feed has nothing. An exception from `decode` leaves `run`, as the real engine's does.
    `result` hands the decoded value over unchanged."""

    max_batch_videos = 1 << 30

    def decode(self, samples: list) -> list:
        raise NotImplementedError

    def run(self, feed: Iterable | Callable[[], Any], emit: Callable[[Any, Any], None]) -> None:
        if not callable(feed):
            it = iter(feed)
            feed = lambda: next(it, None)  # noqa: E731
        while True:
            batch = []
            while len(batch) < self.max_batch_videos and (req := feed()) is not None:
                batch.append(req)
            batch = [r for r in batch if not r.cancelled()]
            if not batch:
                return
            results = self.decode([r.sample for r in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} samples")
            for r, res in zip(batch, results):
                emit(r, res)

    def result(self, sample: Any, decoded: Any) -> Any:
        return decoded


SYNTH = SyntheticConfig(num_videos=2, min_duration=8.0, max_duration=10.0, min_events=2, max_events=3, seed=3, num_workers=1)


def synthetic_videos(out_dir: Path) -> list[Path]:
    from preprocess.synthetic import generate_corpus

    info = generate_corpus(out_dir, SYNTH, progress=False)
    return [Path(info.videos[k]) for k in sorted(info.videos)]


def tiny_engine(cfg: Config):
    """(engine_factory, ModelCard, cfg) for the tiny random-init model, as a replica builds it."""
    from infer.loading import RANDOM_MODEL, load_engine

    return load_engine(cfg, RANDOM_MODEL)


def direct_caption(engine_factory, cfg: Config, path: Path, video_id: str, **infer_overrides):
    """CaptionEngine called directly (no service) on the featurized video -> its VideoResult."""
    from preprocess.featurize import Featurizer, Unannotated

    sample = Featurizer(cfg)(str(path), Unannotated(video_id, source="serve"))
    engine = engine_factory(dataclasses.replace(cfg.infer, **infer_overrides))
    return engine.caption([sample])[0]
