"""Offline captioning's feed: Ray Data batches captioned one at a time against several at once into one engine.

    python -m bench.caption_feed                    # -> bench/results/caption_feed.json
    python -m bench.caption_feed --set infer.videos_per_call=2 --out bench/results/caption_feed_calls2.json

In one process, no Ray, with the job's own stage classes (infer/offline/job.py): the featurize stage
(`FeaturizeForCaption`) turns synthetic videos (preprocess.synthetic, the default preset's tiny random
model, captions capped at 8 tokens, the preset's 16 videos per call and 16 in a step; `--set` changes
one) into batches of `infer.videos_per_call` rows shaped as Ray Data hands them over; then one caption actor (`CaptionVideos`, its engine built once) captions the same batches twice:

  batch_at_a_time   each batch by one blocking engine call over its videos (`caption_each`: what the
                    actor did before), so the engine drains to the batch's last one or two videos
                    before the next batch comes in
  continuous        the actor's async `__call__` on `caption_calls(infer)` batches at once (what Ray
                    Data's max_concurrent_calls_per_actor gives it, in order as Ray Data submits
                    them), their videos fed into the one engine as it has room (the batcher of
                    infer/serving/engine_loop.py): new videos join while earlier ones decode

Printed and written as one JSON object: per mode `videos_decoding_mean` (videos with branch rows per
engine step, averaged over the steps: infer/engine/core.py StepRecord.decoding), `steps`, `wall_s`;
`rows_equal` (every video's row identical in both modes: status, error, duration, events with their
captions, capped); the settings. The batches are all featurized before either mode runs (in a job
they arrive as the featurize actors make them, so the continuous mode's figure is what it reaches
when the featurize stage keeps up). Wall times are of a shared CPU box: the steps are the measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "cluster/configs/default.yaml"
SETTINGS = ["data.synthetic.min_duration=8", "data.synthetic.max_duration=14", "data.synthetic.max_events=4",
            "features.min_frames=16", "features.max_frames=32", "infer.max_events=4", "infer.max_branch_tokens=8",
            "infer.cpu_threads=1"]


def featurized_batches(cfg, videos: int, work: Path) -> list[dict[str, list[Any]]]:
    """`videos` synthetic videos through the job's featurize stage, grouped as the caption stage's batches."""
    from infer.offline.job import FeaturizeForCaption
    from preprocess.synthetic import generate_corpus

    info = generate_corpus(str(work / "synth"), cfg.data.synthetic, progress=False)
    stage = FeaturizeForCaption(cfg.to_json(indent=None))
    rows: list[dict[str, Any]] = []
    for vid in sorted(info.videos):
        out = stage({"video_id": [vid], "uri": [str(info.videos[vid])]})
        rows.append({c: v[0] for c, v in out.items()})
    per = max(1, cfg.infer.videos_per_call)
    return [{c: [r[c] for r in rows[i:i + per]] for c in rows[0]} for i in range(0, len(rows), per)]


def batch_at_a_time(actor, batches: list[dict[str, list[Any]]]) -> list[dict[str, Any]]:
    """Each batch by one blocking engine call (the caption actor before the continuous feed)."""
    from infer.offline.job import batch_items
    from infer.results import caption_each

    fields = {"model_id": actor.model_id, "config_hash": actor.config_hash}
    return [r.to_row() for batch in batches for r in caption_each(actor.engine, batch_items(batch, fields), **fields)]


def continuous(actor, batches: list[dict[str, list[Any]]], calls: int) -> list[dict[str, Any]]:
    """The actor's async calls, `calls` of them at once, submitted in order (as Ray Data's actor pool does)."""
    async def feed() -> list[dict[str, list[Any]]]:
        gate = asyncio.Semaphore(calls)

        async def one(batch):
            async with gate:
                return await actor(batch)

        return await asyncio.gather(*(one(b) for b in batches))

    outs = asyncio.run(feed())
    return [{c: out[c][i] for c in out} for out in outs for i in range(len(out["video_id"]))]


def measure(actor, run) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One mode's rows and its figures (the engine's step log since its stats were reset)."""
    actor.engine.reset_stats()
    t0 = time.perf_counter()
    rows = run()
    wall = time.perf_counter() - t0
    log = actor.engine.stats["step_log"]
    return rows, {"videos_decoding_mean": round(sum(r.decoding for r in log) / len(log), 3) if log else 0.0,
                  "steps": len(log), "wall_s": round(wall, 2), "videos": len(rows)}


def same_rows(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Every video's row identical in what it says about the video (not its timings or chunk)."""
    keys = ("status", "error", "error_kind", "duration", "events", "capped", "segments_kept", "segments_total")
    by_id = {r["video_id"]: r for r in b}
    return len(a) == len(b) == len(by_id) and all(
        r["video_id"] in by_id and all(r[k] == by_id[r["video_id"]][k] for k in keys) for r in a)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench/results/caption_feed.json"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="one more setting over SETTINGS (e.g. infer.videos_per_call=2)")
    args = ap.parse_args(argv)
    import torch

    from infer.loading import RANDOM_MODEL
    from infer.offline.job import CaptionVideos, caption_calls
    from pipeline.config import load_config

    torch.set_num_threads(1)
    settings = [*SETTINGS, f"data.synthetic.num_videos={args.videos}", *args.overrides]
    cfg = load_config(PRESET, settings)
    with tempfile.TemporaryDirectory(prefix="caption-feed-") as work:
        batches = featurized_batches(cfg, args.videos, Path(work))
    actor = CaptionVideos(cfg.to_json(indent=None), RANDOM_MODEL)
    calls = caption_calls(actor.engine.cfg)
    old_rows, old = measure(actor, lambda: batch_at_a_time(actor, batches))
    new_rows, new = measure(actor, lambda: continuous(actor, batches, calls))
    result = {"batch_at_a_time": old, "continuous": {**new, "calls_at_once": calls},
              "rows_equal": same_rows(old_rows, new_rows), "ok_rows": sum(r["status"] == "ok" for r in new_rows),
              "batches": len(batches), "settings": settings, "device": str(actor.engine.device),
              "note": "in one process: the job's featurize and caption stage classes, no Ray; batches featurized beforehand"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
