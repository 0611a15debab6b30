"""Decode speed of the release model's shape through the engine: ms per token and per video.

A random-weight ReleaseCaptioner of the fixture's format (tokenizer, token ids, heads) with
the LLM at `--shape`: `tiny` (the fixture's own sizes, a CPU smoke run) or `3b` (Qwen2.5-VL-3B:
hidden 2048, 36 layers, 16 heads, 2 KV heads, MLP 11008, M-RoPE [16, 24, 24]). Videos carry
stored tokens (their encoders are not timed: prefill onwards), `--timesteps` segments of
`--tokens` video tokens plus 2 audio tokens per second; K and caption lengths are forced
(DecodeControl) so every run decodes the same amount. Reports the engine's decode-phase ms
per step / per token / per video for 1 and `--in-flight` videos at a time, prefill ms, and
the bandwidth floor (the LLM weights read once per step over `--bandwidth-gbs`).

  python bench/release_decode.py --shape tiny --videos 4                         # CPU smoke
  python bench/release_decode.py --shape 3b --device cuda --dtype bfloat16 --out r.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import emit  # noqa: E402
from infer.engine import CaptionEngine  # noqa: E402
from infer.sampling import DecodeControl  # noqa: E402
from pipeline.config import InferConfig  # noqa: E402
from pipeline.release.model import ReleaseCaptioner, ReleaseSettings  # noqa: E402
from pipeline.release.video import ReleaseVideo  # noqa: E402

CHECKPOINT = ROOT / "tests" / "data" / "release_golden" / "checkpoint"
QWEN25_VL_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                    num_key_value_heads=2)


def build(shape: str, device: str, dtype: str) -> ReleaseCaptioner:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(CHECKPOINT, local_files_only=True)
    if shape == "3b":
        text = cfg.get_text_config(decoder=True)
        for k, v in QWEN25_VL_3B.items():
            setattr(text, k, v)
        text.rope_parameters = {**text.rope_parameters, "mrope_section": [16, 24, 24]}
        text.layer_types = ["full_attention"] * QWEN25_VL_3B["num_hidden_layers"]
        cfg.vision_config.out_hidden_size = 2048
    tok = AutoTokenizer.from_pretrained(CHECKPOINT, local_files_only=True)
    with torch.device(device):
        torch.manual_seed(0)
        model = ReleaseCaptioner(cfg, tok, ReleaseSettings(dtype=dtype))
    return model.eval()


def video(i: int, d: int, timesteps: int, tokens: int, seconds: float) -> ReleaseVideo:
    g = torch.Generator().manual_seed(i)
    audio = int(60 * -(-timesteps * seconds // 30))
    return ReleaseVideo(f"v{i}", timesteps * seconds, seconds, (timesteps, 2, 2 * tokens),
                        video_embeds=torch.randn(timesteps * tokens, d, generator=g) * 0.02,
                        audio_embeds=torch.randn(audio, d, generator=g) * 0.02)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=["tiny", "3b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--timesteps", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=66, help="video tokens per timestep (720p at 256 frames: 66)")
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--caption-tokens", type=int, default=48)
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="H200 HBM3e: 4.8 TB/s")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    model = build(args.shape, args.device, args.dtype)
    d = model.hidden_size
    vids = [video(i, d, args.timesteps, args.tokens, 1.0) for i in range(args.videos)]
    control = DecodeControl(num_events=args.events, lengths=[args.caption_tokens])
    llm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "language_model" in n)
    out = {"shape": args.shape, "device": args.device, "dtype": args.dtype,
           "events": args.events, "caption_tokens": args.caption_tokens, "modes": {},
           "floor_ms_per_step": llm_bytes / (args.bandwidth_gbs * 1e9) * 1e3, "llm_gb": llm_bytes / 1e9}
    for n in (1, args.in_flight):
        cfg = InferConfig(max_events=args.events, max_branch_tokens=args.caption_tokens + 1, device=args.device,
                          dtype=args.dtype, max_batch_videos=n, max_batch_rows=n * args.events)
        eng = CaptionEngine(model, cfg)
        eng.caption(vids[:1], controls=[control])  # warm-up (kernels, graphs)
        eng.stats.update(steps=0, row_steps=0, step_ms=0.0, front_ms=0.0)
        t0 = time.perf_counter()
        res = eng.caption(vids, controls=[control] * len(vids))
        wall = time.perf_counter() - t0
        tokens = sum(r.timings.get("tokens", 0) for r in res)
        s = eng.stats
        out["modes"][f"in_flight_{n}"] = {
            "ms_per_step": s["step_ms"] / max(s["steps"], 1), "decode_ms_per_token": s["step_ms"] / max(tokens, 1),
            "ms_per_video": wall * 1e3 / len(vids), "prefill_ms_per_video": s["front_ms"] / len(vids),
            "tokens": tokens, "steps": s["steps"], "errors": sum(1 for r in res if r.error)}
    return emit(out, args.out)


if __name__ == "__main__":
    main()
