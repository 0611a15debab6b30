"""Load the model a serving replica (or a benchmark) decodes with: a saved PadCaptioner, a release
checkpoint (the published PadCaptioner-3B's directory), or the tiny smoke model.

    engine_factory, card, cfg = load_engine(cfg, model_dir)
    engine = engine_factory(cfg.infer)          # infer.engine.core.CaptionEngine(model, infer_cfg)
    model_id, cfg = resolve_model(cfg, model_dir)   # the same id and features, no weights loaded

model_dir = a directory written by `PadCaptioner.save_pretrained` (the training
stage's <run_dir>/train/model). When it also holds the run's `config.json`, its
`features` section replaces the serving config's: the encoders must produce what
the model was trained on. model_dir = RANDOM_MODEL ("random:tiny", the command lines'
`--random-model`) is the smoke mode: a fresh `tiny` random-init model (seeded by
model.backbone_seed, so every replica and every test builds the same weights) sized to
the configured feature encoders, whose model id says `tiny-random`; the endpoint then
works end to end but its captions are noise. No model at all (model_dir "") is an error,
never a silent random model.

The device is infer.device (auto = CUDA when available); LoRA is merged into the
backbone weights at load (nothing trains here), and the engine decodes in
infer.dtype (auto = bfloat16 on CUDA). Pure torch, no ray.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config, ConfigError, section_hash
from pipeline.release.checkpoint import is_release_dir

log = logging.getLogger("padcap.serve")
CONFIG_FILE = "config.json"
RANDOM_MODEL = "random:tiny"  # the model argument for a fresh random tiny model (smoke tests: captions are noise)
NO_MODEL = ("no model given: pass --model DIR (a trained model dir or a release checkpoint dir), "
            "or --random-model for a random tiny model whose captions are noise")


def require_model(model_dir: str) -> str:
    """`model_dir` when it names a model (a directory or RANDOM_MODEL); a ConfigError when it is empty.

    >>> require_model(RANDOM_MODEL)
    'random:tiny'
    >>> try:
    ...     require_model("")
    ... except ConfigError as e:
    ...     print(e)
    no model given: pass --model DIR (a trained model dir or a release checkpoint dir), or --random-model for a random tiny model whose captions are noise
    """
    if not str(model_dir or "").strip():
        raise ConfigError(NO_MODEL)
    return str(model_dir)


@dataclasses.dataclass
class ModelCard:
    """What GET /v1/model reports about the loaded model."""

    model_id: str
    source: str  # the model dir, or "tiny (random init, smoke mode)"
    device: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def serving_model(cfg: Config, model_dir: str = "") -> str:
    """The one model an endpoint serves: `model_dir` or `serve.model_dir`, never both differently, never none.

    >>> from pipeline.config import load_config
    >>> serving_model(load_config(None, ["serve.model_dir=/models/a"]))
    '/models/a'
    >>> try:
    ...     serving_model(load_config(None, ["serve.model_dir=/models/a"]), "/models/b")
    ... except ConfigError as e:
    ...     print(e)
    the model is named twice: model_dir='/models/b' and serve.model_dir='/models/a'; name it once
    """
    if model_dir and cfg.serve.model_dir and model_dir != cfg.serve.model_dir:
        raise ConfigError(f"the model is named twice: model_dir={model_dir!r} and serve.model_dir={cfg.serve.model_dir!r}; "
                          "name it once")
    return require_model(model_dir or cfg.serve.model_dir)


def _trained_features(model_dir: Path, cfg: Config) -> Config:
    path = model_dir / CONFIG_FILE
    if not path.exists():
        return cfg
    try:
        trained = Config.from_json(path.read_text())
    except (ValueError, ConfigError) as e:
        raise ValueError(f"{path}: not a readable run config ({e})") from e
    # what the features are comes from training; where the encoders run (features.device) is this run's
    features = dataclasses.replace(trained.features, device=cfg.features.device)
    if features != cfg.features:
        log.warning("using the features section the model was trained with (%s), not the serving config's", path)
    return dataclasses.replace(cfg, features=features)


def weights_fingerprint(model_dir: Path, length: int = 8) -> str:
    """Content hash of every file in a saved model directory (weights, configs, tokenizer).

    It names *these* weights: a retrained model saved to the same directory gets a new id,
    so captions written with the old one (infer/offline/job.py resume) are never taken for its own.
    Reading a 3B checkpoint's ~9 GB takes a while, and every caption actor and replica asks, so the
    hash is kept in a per-machine cache ($PADCAP_CACHE_DIR/fingerprints, else
    ~/.cache/padcaptioner/fingerprints) under the directory's file list
    with each file's size, mtime and inode: a file rewritten in any way changes that key.
    """
    files = {str(p.relative_to(model_dir)): p for p in sorted(model_dir.rglob("*")) if p.is_file()}
    stats = [(name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in ((n, f.stat()) for n, f in files.items())]
    key = hashlib.sha256(repr((str(model_dir.resolve()), length, stats)).encode()).hexdigest()
    cache_root = os.environ.get("PADCAP_CACHE_DIR") or Path.home() / ".cache" / "padcaptioner"
    cache = Path(cache_root) / "fingerprints" / f"{key[:40]}.txt"
    try:
        return cache.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    for name, f in files.items():
        h.update(name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    digest = h.hexdigest()[:length]
    try:  # atomically: actors on one machine may ask at once
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, cache)
    except OSError as e:  # a read-only home: hash every time
        log.debug("fingerprint cache %s not written: %s", cache, e)
    return digest


def release_config(cfg: Config, path: Path) -> Config:
    """cfg for a release checkpoint: its own encoders (the checkpoint's vision tower and Whisper +
    Q-Former), run online by the engine on its device, so a replica holds one copy of them."""
    f = cfg.features
    if (f.visual_encoder, f.audio_encoder) != ("release", "release") or f.release_path not in ("", str(path)):
        log.warning("a release checkpoint captions with its own encoders: features set to release / %s", path)
    features = dataclasses.replace(f, visual_encoder="release", audio_encoder="release", release_path=str(path),
                                   release_features="online")
    return dataclasses.replace(cfg, features=features)


def release_dir(model_dir: str) -> Path | None:
    path = Path(model_dir).expanduser() if model_dir and model_dir != RANDOM_MODEL else None
    return path.resolve() if path is not None and is_release_dir(path) else None


def resolve_model(cfg: Config, model_dir: str) -> tuple[str, Config]:
    """(model id, cfg with the features the model captions with): what `load_model` gives as its card's
    id and its config, without loading any weight (what a driver needs to resume a captioning job)."""
    release = release_dir(require_model(model_dir))
    if release is not None:
        return f"{release.name}-{weights_fingerprint(release)}", release_config(cfg, release)
    if model_dir != RANDOM_MODEL:
        path = Path(model_dir).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"model {model_dir}: no such directory (a trained model dir or a release checkpoint dir)")
        return f"{path.name}-{weights_fingerprint(path)}", _trained_features(path, cfg)
    return f"tiny-random-seed{cfg.model.backbone_seed}", cfg


def load_model(cfg: Config, model_dir: str) -> tuple[Any, ModelCard, Config]:
    """(PadCaptioner or ReleaseCaptioner in eval mode on its device, its card, cfg with the matching
    features). model_dir may be a saved PadCaptioner or a release checkpoint directory
    (config.json + pytorch_model.bin / safetensors: pipeline/release)."""
    from infer.engine.requests import resolve_device
    from pipeline.model import PadCaptioner

    device = resolve_device(cfg.infer.device)
    model_id, cfg = resolve_model(cfg, model_dir)  # a release: cfg with the release encoders
    release = release_dir(model_dir)
    if release is not None:
        from pipeline.release.model import ReleaseCaptioner, settings_from

        model = ReleaseCaptioner.from_release(release, settings_from(cfg), device=device).eval().requires_grad_(False)
        card = ModelCard(model_id=model_id, source=f"{release} (PadCaptioner release)", device=str(device),
                         extra={"release": model.describe()})
        return model, card, cfg
    from preprocess.encoders import encoder_dims

    dv, da = encoder_dims(cfg.features)  # from the encoders' configs: no tower is loaded for this
    if model_dir != RANDOM_MODEL:
        path = Path(model_dir).expanduser().resolve()
        model = PadCaptioner.from_pretrained(path)
        if (model.cfg.visual_dim, model.cfg.audio_dim) != (dv, da):
            raise ValueError(f"{path}: the model takes features of dims ({model.cfg.visual_dim}, {model.cfg.audio_dim}) "
                             f"but the configured encoders give ({dv}, {da}); serve with the features config it was trained on")
        source = str(path)
    else:
        model_cfg = dataclasses.replace(cfg.model, backbone="tiny")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model_cfg.backbone_seed)
            model = PadCaptioner(model_cfg, visual_dim=dv, audio_dim=da)
        source = "tiny (random init, smoke mode: captions are noise)"
    model = model.to(device).eval().requires_grad_(False)
    model.backbone.merge_adapter()  # LoRA folded into the weights: what the benchmark measures, no adapter matmuls
    card = ModelCard(model_id=model_id, source=source, device=str(device),
                     extra={"model_config_hash": section_hash(dataclasses.asdict(model.cfg))})
    return model, card, cfg


def load_engine(cfg: Config, model_dir: str) -> tuple[Callable[[Any], Any], ModelCard, Config]:
    """(InferConfig -> CaptionEngine factory sharing one loaded model, card, cfg); infer.decoder=monolithic
    decodes with the model's own single-chain baseline (infer/oracles/ablation.py `caption_engine`)."""
    from infer.oracles.ablation import caption_engine

    model, card, cfg = load_model(cfg, model_dir)
    return functools.partial(caption_engine, model), card, cfg

