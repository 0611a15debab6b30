"""Offline captioning throughput: many videos per step vs one at a time vs the monolithic decoder.

    python -m bench.caption [--model runs/default/train/model] [--videos 12] [--seconds 30]
    python -m bench.caption --shape bench-small        # a random model of the cpu-small shape

Generates a synthetic corpus, then runs the same Ray Data captioning job
(infer/offline/job.py: featurize actor pool -> engine actor pool -> JSONL/Parquet) three times
on the same videos: `batched` (the parallel engine, infer.videos_per_call videos handed
to each engine call and decoded together, up to infer.max_batch_videos per step),
`one_at_a_time` (the parallel engine with infer.videos_per_call=1 and
infer.max_batch_videos=1: each video decoded alone, its K branches per step) and
`monolithic` (infer.decoder=monolithic), and prints JSON with videos/minute of each and
the ratios (after an untimed warm-up job), plus the engines' decode time per generated token
(the two decoders caption freely, so they need not write the same number of tokens). With no `--model` (or a missing one) a random tiny model is used; its
branches never end early, so every caption runs to `infer.max_branch_tokens`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_model(cfg, out: str) -> str:
    """A random-init PadCaptioner of bench/decode.py's cpu-small backbone shape, saved under `out`.

    The backbone is written as a local HF directory (the captioning actors rebuild it from
    the path), the model on top of it with the configured encoders' feature dims.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from bench.decode import BENCH_SHAPE
    from pipeline import backbone as backbone_mod
    from pipeline.model import PadCaptioner
    from pipeline.tokens import build_tokenizer
    from preprocess.encoders import encoder_dims

    backbone_mod.PRESETS.setdefault("bench-small", BENCH_SHAPE)
    hf_cfg = backbone_mod.preset_config("bench-small", len(build_tokenizer(cfg.model)))
    torch.manual_seed(0)
    base_dir = os.path.join(out, "backbone")
    AutoModelForCausalLM.from_config(copy.deepcopy(hf_cfg)).save_pretrained(base_dir)
    dv, da = encoder_dims(cfg.features)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone = base_dir
    PadCaptioner(model_cfg, visual_dim=dv, audio_dim=da).save_pretrained(os.path.join(out, "padcaptioner"))
    return os.path.join(out, "padcaptioner")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "runs/default/train/model"))
    ap.add_argument("--videos", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--shape", default="", choices=["", "bench-small"],
                    help="instead of --model: a random-init model of this backbone shape (bench/decode.py's cpu-small: "
                         "hidden 512, 8 layers), saved to a temp dir, so decoding weighs what it does for a real model")
    ap.add_argument("--max-events", type=int, default=8, help="infer.max_events (a random model plans up to it)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import ray

    from infer.offline.job import run_caption
    from infer.offline.results import read_results
    from pipeline.config import load_config
    from preprocess.synthetic import generate_corpus

    model = args.model if Path(args.model).is_dir() else ""
    base = load_config(ROOT / "cluster/configs/default.yaml", [
        f"data.synthetic.num_videos={args.videos}", f"data.synthetic.min_duration={args.seconds}",
        f"data.synthetic.max_duration={args.seconds}", "data.synthetic.seed=7", f"infer.max_events={args.max_events}",
        f"infer.max_branch_tokens={args.max_tokens}", "cluster.preprocess_actors=1", "cluster.caption_actors=1"])
    tmp = tempfile.mkdtemp(prefix="bench-caption-")
    if args.shape:
        model = random_model(base, os.path.join(tmp, "model"))
    info = generate_corpus(os.path.join(tmp, "synth"), base.data.synthetic, progress=False)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    result = {"videos": len(info.videos), "seconds_per_video": args.seconds,
              "model": f"{args.shape} random" if args.shape else (model or "tiny random"),
              "max_branch_tokens": args.max_tokens}
    try:
        # Warm-up (not timed): the first Ray Data job of a process pays worker start-up and imports.
        run_caption(base, [{"video_id": v, "uri": u} for v, u in sorted(info.videos.items())[:1]], model,
                    os.path.join(tmp, "warmup"))
        from pipeline.config import apply_overrides

        runs = {"batched": [], "one_at_a_time": ["infer.videos_per_call=1", "infer.max_batch_videos=1"],
                "monolithic": ["infer.decoder=monolithic", "infer.videos_per_call=1"]}
        for decoder, overrides in runs.items():
            cfg = apply_overrides(base, overrides)
            t0 = time.perf_counter()
            summary = run_caption(cfg, info.video_dir, model, os.path.join(tmp, decoder))
            seconds = time.perf_counter() - t0
            rows = read_results(os.path.join(tmp, decoder))
            tokens = sum(r["timings"].get("tokens", 0) for r in rows)
            decode_ms = sum(r["timings"].get("decode_ms", 0) for r in rows)
            result[decoder] = {"seconds": seconds, "videos_per_minute": 60 * len(rows) / seconds,
                               "captioned": summary["captioned"], "failed": summary["failed"],
                               "tokens": tokens, "engine_decode_ms": decode_ms,
                               "engine_ms_per_token": decode_ms / max(tokens, 1)}
    finally:
        ray.shutdown()
    vpm = {k: result[k]["videos_per_minute"] for k in runs}
    result["batched_over_one_at_a_time_videos_per_minute"] = vpm["batched"] / vpm["one_at_a_time"]
    result["batched_over_monolithic_videos_per_minute"] = vpm["batched"] / vpm["monolithic"]
    result["one_at_a_time_over_monolithic_videos_per_minute"] = vpm["one_at_a_time"] / vpm["monolithic"]
    # The decoders caption freely, so they may write different amounts: compare per token too. A video's
    # decode_ms is its wall time in the shared steps, so only the one-at-a-time runs' sums are decode time.
    result["one_at_a_time_over_monolithic_ms_per_token"] = (result["monolithic"]["engine_ms_per_token"]
                                                            / max(result["one_at_a_time"]["engine_ms_per_token"], 1e-9))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
