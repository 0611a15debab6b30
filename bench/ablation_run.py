"""One ablation run: train one variant with one seed, then decode the held-out videos.

    record = run_variant(cfg, shards, out_dir, eval_videos=32)   # also written to out_dir/run.json

Training is train/loop.py in this process (`LocalContext`, one rank, one torch thread),
on the records of shards["train"] in a seeded order (`InMemoryEpochs`), exactly as a
Ray Train worker runs it. The published model is reloaded with
`PadCaptioner.from_pretrained` and every held-out video is decoded ALONE (one video per
call, greedy, the same infer.* settings for every variant) by the decoder its layout
needs (infer/oracles/ablation.py `decoder_for`: the parallel engine for PadCaptioner and the
aggregation variants, `layout_ordered` for the causal mask and own-<G> visibility,
`monolithic` for the chain, `text_chain` for the text baselines). The first video is
decoded once untimed (warm-up) so no variant pays one-off set-up in its latency.
The record keeps every video's raw output (events, or the text to be parsed by the
metrics), its decode wall time and generated tokens, and the held-out attribute
accuracies (train/evaluate.py `engine_counts`, synthetic grammar).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config


def _decode_all(model, cfg: Config, samples: list) -> tuple[dict[str, dict], list[dict[str, float]], str]:
    from infer.oracles.ablation import caption_engine, decode_events, decoder_for

    decoder = decoder_for(model)
    if decoder is None:
        engine = caption_engine(model, cfg.infer)

        def one(sample):
            res = engine.caption([sample])[0]
            if res.error:
                return {"error": res.error}, res.timings
            return {"events": [{"start": e.start, "end": e.end, "caption": e.caption} for e in res.events]}, res.timings
        name = "parallel engine"
    else:
        def one(sample):
            return decode_events(model, decoder, sample, cfg.infer)
        name = decoder.__name__
    one(samples[0])  # warm-up, untimed
    outputs, costs = {}, []
    for s in samples:
        t0 = time.perf_counter()
        out, timings = one(s)
        ms = (time.perf_counter() - t0) * 1000.0
        outputs[s.video_id] = out
        costs.append({"ms": ms, "tokens": float(timings.get("tokens", 0.0))})
    return outputs, costs, name


def run_variant(cfg: Config, shards: dict[str, str] | None, out_dir: str | Path, eval_videos: int = 0,
                data: tuple[list, list] | None = None, probe=None) -> dict[str, Any]:
    """Train + decode one variant (module doc); returns the record written to out_dir/run.json.

    data: (training records, held-out samples) already read (instead of `shards`); probe: the
    loop's probe hook (train/loop.py), whose history then goes into the record."""
    from infer.oracles.ablation import output_events
    from pipeline.model import PadCaptioner
    from train import checkpoint as ckpt
    from train.data import InMemoryEpochs, read_samples, read_shard_records
    from train.evaluate import caption_parser, engine_counts, summary
    from train.loop import LocalContext, train_loop

    torch.set_num_threads(1)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)  # a rerun trains from step 0, never resumes an older run
    out.mkdir(parents=True)
    if data is None:
        records, test = list(read_shard_records([shards["train"]])), read_samples([shards["test"]], limit=eval_videos)
    else:
        records, test = data
    if not records or not test:
        raise RuntimeError(f"no training records ({len(records)}) or held-out videos ({len(test)}) in {shards}")
    dims = test[0].visual.shape[2], test[0].audio.shape[2]
    ctx = LocalContext(root=str(out / "ckpt"))
    parse = caption_parser(cfg)
    t0 = time.perf_counter()
    trained = train_loop(cfg, ctx, InMemoryEpochs(records, seed=cfg.train.seed), test, visual_dim=dims[0],
                         audio_dim=dims[1], parse=parse, probe=probe)
    train_s = time.perf_counter() - t0
    final = Path(ctx.latest_checkpoint())
    history = ckpt.read_history(final) if probe is not None else None
    model = PadCaptioner.from_pretrained(final / "model").eval()
    t1 = time.perf_counter()
    outputs, costs, decoder = _decode_all(model, cfg, test)
    decode_s = time.perf_counter() - t1
    events = [output_events(outputs[s.video_id]) if "error" not in outputs[s.video_id] else [] for s in test]
    held = summary(engine_counts(test, events, parse))
    held.pop("token_acc")
    last = trained["metrics"]
    record = {
        "train": {"steps": trained["steps"], "seconds": round(train_s, 1),
                  "loss_last": {k: round(float(last[k]), 4) for k in ("total", "lm", "branch_lm", "grounding") if k in last},
                  "data": trained["data"]},
        "decoder": decoder,
        "decode_seconds": round(decode_s, 1),
        "heldout": {k: round(float(v), 4) for k, v in held.items()},
        "costs": costs,
        "outputs": outputs,
    }
    if history is not None:
        record["history"] = history
    shutil.rmtree(out / "ckpt", ignore_errors=True)  # models are not kept: the record is the result
    (out / "run.json").write_text(json.dumps(record, indent=1))
    return record
