"""The engine the serving tests use, and the synthetic videos they caption.

    corpus = synthetic_videos(tmp_dir)         # real mp4s from preprocess.synthetic (2 videos, ~8-10 s)
    factory, card, cfg = tiny_engine(cfg)      # infer.loading: tiny PadCaptioner, random init, seeded
    direct = direct_caption(factory, cfg, path)  # CaptionEngine called directly on the featurized video
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.config import Config, SyntheticConfig

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
    from infer.serving.service import NoAnnotation
    from preprocess.featurize import Featurizer

    sample = Featurizer(cfg)(str(path), NoAnnotation(video_id))
    engine = engine_factory(dataclasses.replace(cfg.infer, **infer_overrides))
    return engine.caption([sample])[0]
