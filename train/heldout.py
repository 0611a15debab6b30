"""End-of-stage evaluation of a trained model on held-out videos (driver side, no ray).

    numbers = evaluate_heldout(cfg, "runs/default/train/model", test_shard_paths)

Loads the published model with `PadCaptioner.from_pretrained` (so the saved format is
exercised), reads the held-out split's samples and reports the numbers of
train/evaluate.py twice:
  teacher_forced  one forward per video with the true layout (true K, true intervals
                  for the anchors); exact and fast;
  free_running    the real decoder (infer.engine.core.CaptionEngine: greedy planning,
                  grounding, parallel branch decoding; an ablation model decodes in its
                  own training layout, infer/oracles/ablation.py `decoder_for`), compared with the references
                  (with the unique / repeated attribute split and the overlap grounding where the
                  videos have them, and a text baseline's parse failures, pipeline/textual.py).
                  Used when infer/engine/core.py is importable; otherwise reported as
                  unavailable with the reason.
`headline` names which of the two the top-level numbers come from (free-running when
available). Attribute accuracies need a caption parser: the synthetic grammar's
`parse_caption` for the synthetic dataset, none otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config
from pipeline.textual import parse_failures
from train.data import Batcher, read_samples
from train.evaluate import EvalCounts, caption_parser, engine_counts, heldout_counts, summary

HEADLINE = ("planning_acc", "grounding_f1@0.5", "token_acc", "colour_acc", "shape_acc", "motion_acc", "sound_acc",
            "attr_acc")


@torch.no_grad()
def teacher_forced(model, samples: list, parse=None) -> dict[str, float]:
    counts = EvalCounts()
    batcher = Batcher(model, 1)
    for batch in batcher(samples):  # one batch per usable sample, in order
        out = model.forward_train(batch)
        counts += heldout_counts(model, batch, out, parse)
    out = summary(counts)
    out["skipped"] = batcher.stats.skipped
    return out


@torch.no_grad()
def free_running(model, cfg: Config, samples: list, parse=None) -> dict[str, Any]:
    """The engine's captions scored against the references, or {"unavailable": reason}."""
    try:
        from infer.oracles.ablation import caption_engine, decode_events, decoder_for, output_events
    except ImportError as e:
        return {"unavailable": f"infer.engine.core not importable ({e})"}

    from infer.engine.requests import model_caps

    model = model.decoding_model  # the release fine-tuning wrapper: its ReleaseCaptioner decodes
    infer_cfg = model_caps(cfg.infer, model)  # 0 = the model's own caps
    ablation = decoder_for(model)  # an ablation model decodes in its own training layout
    t0 = time.perf_counter()
    if ablation is None:
        results = caption_engine(model, infer_cfg).caption(samples)
        events = [[(float(e.start), float(e.end), str(e.caption)) for e in r.events] for r in results]  # VideoResults
        errors, name = sum(1 for r in results if getattr(r, "error", None)), infer_cfg.decoder
        texts: list[str] = []
    else:
        outputs = [decode_events(model, ablation, s, infer_cfg)[0] for s in samples]
        events, texts = [output_events(o) for o in outputs], [o["text"] for o in outputs if "text" in o]
        errors, name = 0, ablation.__name__
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = summary(engine_counts(samples, events, parse))
    out.pop("token_acc")  # teacher-forced only
    if texts:  # a text baseline: how its timestamps failed to parse
        out.update(parse_failures(texts))
    out["seconds_per_video"] = seconds / max(1, len(samples))
    out["decoder"] = name
    out["engine_errors"] = errors
    return out


def evaluate_heldout(cfg: Config, model_dir: str | Path, shard_paths) -> dict[str, Any]:
    """Teacher-forced and free-running numbers on the held-out split (see the module doc).

    shard_paths: shard paths, or {shard: keys} (`preprocess.manifest.current_keys`: the
    manifest's current samples only, sorted by key)."""
    from pipeline.model import PadCaptioner
    from pipeline.release.checkpoint import is_release_dir
    from pipeline.release.finetune import release_tuner

    samples = read_samples(shard_paths, limit=cfg.train.eval_samples)
    if not samples:
        return {"videos": 0, "note": "no held-out samples"}
    if is_release_dir(model_dir):  # a fine-tuned release model: teacher-forced through its training wrapper
        model = release_tuner(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, backbone=str(model_dir)))).eval()
    else:
        model = PadCaptioner.from_pretrained(model_dir).eval()
    parse = caption_parser(cfg)
    if cfg.infer.cpu_threads > 0 and model.device.type == "cpu":
        torch.set_num_threads(cfg.infer.cpu_threads)  # the engine's count for both modes: same numbers on any core count
    tf = teacher_forced(model, samples, parse)
    try:
        fr = free_running(model, cfg, samples, parse)
    except Exception as e:  # a decoder failure must not hide the training result; it is reported
        fr = {"unavailable": f"engine failed: {type(e).__name__}: {e}"}
    head, name = (fr, "free_running") if "unavailable" not in fr else (tf, "teacher_forced")
    r = lambda d: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
    return {"videos": len(samples), "headline": name, **{k: round(head[k], 4) for k in HEADLINE if k in head},
            "teacher_forced": r(tf), "free_running": r(fr)}
