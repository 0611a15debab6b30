"""The release's media towers as their own stage: vision-tower attention calls and time, and decode-step stalls.

vision: a Qwen2.5-VL vision tower with the release's geometry (14 px patches, 2-frame timesteps, 112 px
windows, 2 x 2 merge, full attention in every 8th block) at a reduced width (random weights), on T
timesteps of a 720p frame (728 x 1288 px: 52 x 92 patches): SDPA calls per forward and wall time, HF's
per-window attention ("sdpa") against pipeline/release/video.py `window_attention`, and their largest
difference. The calls of HF's loop are counted, not estimated: one per window per windowed block, one
per frame per full block.

stalls: the tiny release model (tests/data/release_golden) decoding while raw videos (pixels and log-mel)
keep arriving, one every `--every` steps: the longest gap between two decode steps, the loop's own time
building programs (the towers included when they run in it), the stage's encoding time and the total
wall time, with the encoder stage (infer/engine/encoding.py) and with the towers run inside the loop as
before (the program encoding its own video, the stage bypassed), alternating; captions compared.

Run:  python -m bench.release_encoding --timesteps 4 --width 128 --depth 8 --out bench/results/release_encoding.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from bench.output import command, emit
from bench.release_models import perturbed, random_video
from infer.engine.core import CaptionEngine
from infer.engine.programs import ReleaseProgram
from infer.engine.requests import Request
from pipeline.config import InferConfig
from pipeline.release.video import WINDOW_ATTENTION


class CallCounter:
    """Counts torch SDPA calls (HF's sdpa integration and `window_attention` both look it up at call time)."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        real = self.real = F.scaled_dot_product_attention

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)

        F.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.real


def vision(timesteps: int, width: int, depth: int, device: str) -> dict:
    cfg = Qwen2_5_VLVisionConfig(depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=max(1, width // 80),
                                 out_hidden_size=width, fullatt_block_indexes=list(range(depth - 1, -1, -8))[::-1])
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, attn_implementation="sdpa").to(device).eval()
    grid = torch.tensor([[timesteps, 52, 92]], device=device)
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, device=device)
    out = {}
    for name in ("sdpa", WINDOW_ATTENTION):
        tower.config._attn_implementation = name
        with torch.no_grad(), CallCounter() as count:
            tower(pixels, grid_thw=grid)  # warm-up, and the count
            _sync(device)
            t0 = time.perf_counter()
            res = tower(pixels, grid_thw=grid).pooler_output
            _sync(device)
        out[name] = (res, count.calls // 2, time.perf_counter() - t0)
    (hf, hf_calls, hf_s), (ours, our_calls, our_s) = out["sdpa"], out[WINDOW_ATTENTION]
    return {"timesteps": timesteps, "patches": int(grid.prod()), "width": width, "depth": depth, "device": device,
            "hf_sdpa_calls": hf_calls, "windowed_sdpa_calls": our_calls, "hf_s": round(hf_s, 3),
            "windowed_s": round(our_s, 3), "speedup": round(hf_s / our_s, 2),
            "max_abs_diff": float((hf - ours).abs().max()), "max_abs": float(hf.abs().max())}


def stalls(videos: int, every: int, timesteps: int, rounds: int) -> dict:
    model = perturbed(5, eos_gain=0.75)
    raw = [random_video(100 + i, timesteps=timesteps, rows=52, cols=92) for i in range(videos)]
    out, tokens, own = {"in_loop": [], "stage": []}, {}, ReleaseProgram.__dict__["tokens_to_encode"]
    for mode in ("in_loop", "stage") * rounds:  # alternating: a busy box's drift falls on both
        eng = CaptionEngine(model, InferConfig(max_events=model.max_events, max_branch_tokens=model.max_branch_tokens + 1,
                                               device="cpu"))
        if mode == "in_loop":  # the stage passes every video through: the program encodes it in the loop
            ReleaseProgram.tokens_to_encode = staticmethod(lambda sample: 0)
        pending, results, stamps = list(raw), {}, []

        def feed():
            stamps.append(time.perf_counter())
            steps = eng.stats["steps"]
            if pending and (not eng._in_flight or steps % every == 0):
                return Request(pending.pop(0))
            return None

        t0 = time.perf_counter()
        eng.run(feed, lambda req, res: results.setdefault(req.sample.video_id, res))
        wall = time.perf_counter() - t0
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        st = eng.stats
        out[mode].append({"wall_s": round(wall, 3), "longest_step_gap_ms": round(1000 * max(gaps), 1),
                          "loop_prepare_ms": round(st["prepare_ms"], 1), "stage_encode_ms": round(st["encode_ms"], 1),
                          "steps": st["steps"], "encode_batches": st["encode_batches"]})
        tokens.setdefault(mode, [results[v.video_id].tokens for v in raw])
        if mode == "in_loop":
            ReleaseProgram.tokens_to_encode = own
    return {"videos": videos, "every_steps": every, "timesteps": timesteps, "patches_per_video": timesteps * 52 * 92,
            **out, "captions_equal": tokens["in_loop"] == tokens["stage"]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timesteps", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--videos", type=int, default=6)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--stall-timesteps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="stall runs per mode, alternating")
    ap.add_argument("--key", default="", help="results key (default: the device)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = {"vision": vision(args.timesteps, args.width, args.depth, args.device),
              "command": command("release_encoding", argv)}
    if args.device == "cpu":
        result["stalls"] = stalls(args.videos, args.every, args.stall_timesteps, args.rounds)
    if args.out and args.out.exists():  # older keys kept
        result = {**json.loads(args.out.read_text()), args.key or args.device: result}
    elif args.out:
        result = {args.key or args.device: result}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
