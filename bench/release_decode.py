"""Decode speed of the release model's shape through the engine: ms per token and per video.

A random-weight ReleaseCaptioner of the fixture's format (tokenizer, token ids, heads) with
the LLM at `--shape`: `tiny` (the fixture's own sizes, a CPU smoke run) or `3b` (Qwen2.5-VL-3B:
hidden 2048, 36 layers, 16 heads, 2 KV heads, MLP 11008, M-RoPE [16, 24, 24]). Videos carry
stored tokens (their encoders are not timed: prefill onwards), `--timesteps` segments of
`--tokens` video tokens plus 2 audio tokens per second; K and caption lengths are forced
(DecodeControl) so every run decodes the same amount. Reports, for 1 and each `--in-flight`
count: the median decode-only step with that many videos decoding, over the bandwidth floor
(the LLM weights read once per step over `--bandwidth-gbs`), decode tokens/s over one at a
time, whether every video's tokens equal its one-at-a-time tokens in this dtype (else the
first differing token and the alone decode's logit margin there), the kernel, and on CUDA the
peak memory and the KV pool.

  python -m bench.release_decode --shape tiny --videos 4                         # CPU smoke
  python -m bench.release_decode --shape 3b --device cuda --dtype bfloat16 --in-flight 16 64 --out r.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from bench.output import emit
from infer.engine.core import CaptionEngine
from infer.engine.requests import Request
from infer.engine.sampling import DecodeControl
from pipeline.config import InferConfig
from pipeline.release.model import ReleaseCaptioner, ReleaseSettings
from pipeline.release.video import ReleaseVideo

ROOT = Path(__file__).resolve().parents[1]

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


def planned_bytes(model, eng, step_tokens: int) -> int:
    """What infer.engine.memory_plan predicts this process holds: the weights, the engine's KV pool, the working memory
    of its largest step (CUDA context included)."""
    from infer.engine.memory_plan import Shape, working_bytes

    w = eng.weights
    shape = Shape(w.num_layers, w.hidden, w.heads, w.kv_heads, w.head_dim, w.layers[0].up[0].shape[0], w.head.shape[0])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    size = w.embed.element_size()
    return weights + eng.pool.pages * eng.pool.bytes_per_page + working_bytes(shape, step_tokens, eng.cfg.max_batch_rows, size)


def first_difference(model, vid, control, cfg, alone, batched) -> dict:
    """Where a video's batched tokens first differ from alone, and the alone decode's logit margin there
    (top-1 minus top-2: how close the choice was)."""
    for e, (a, b) in enumerate(zip(alone, batched)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                traced = CaptionEngine(model, dataclasses.replace(cfg, max_batch_videos=1)).decode(
                    vid, dataclasses.replace(control, trace=True))
                top = traced.branch_logits[e][j].float().topk(2).values
                return {"event": e, "position": j, "alone": x, "batched": y, "margin": float(top[0] - top[1])}
    return {"event": None, "note": "equal tokens, different lengths"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=["tiny", "3b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[8])
    ap.add_argument("--timesteps", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=66, help="video tokens per timestep (720p at 256 frames: 66)")
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--caption-tokens", type=int, default=48)
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="H200 HBM3e: 4.8 TB/s")
    ap.add_argument("--eager-at", type=int, nargs="*", default=[],
                    help="also run these in-flight counts with infer.cuda_graphs=off (mode in_flight_N_eager): "
                         "the graphs' gain, side by side")
    ap.add_argument("--kv-memory-gb", type=float, default=0.0,
                    help="every engine's KV pool (0 = auto: a share of the free memory, so each engine's pool, and "
                         "with it compiled flex's shapes, differs; a fixed size compiles them once)")
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
    tokens_by_mode = {}
    cfg = None
    for n, graphs in [(1, "auto"), *((n, "auto") for n in args.in_flight), *((n, "off") for n in args.eager_at)]:
        cfg = InferConfig(max_events=args.events, max_branch_tokens=args.caption_tokens + 1, device=args.device,
                          dtype=args.dtype, max_batch_videos=n, max_batch_rows=n * args.events, step_tokens=1 << 30,
                          cuda_graphs=graphs, kv_memory_gb=args.kv_memory_gb,
                          # a decode step of n videos carries up to n x events rows: recorded up to that, so the
                          # 64-in-flight steps replay graphs too (the default 256 would leave them eager)
                          graph_tokens=max(InferConfig.graph_tokens, n * args.events))
        eng = CaptionEngine(model, cfg)
        eng.caption(vids[:1], controls=[control])  # warm-up (kernels, compilation)
        eng.reset_stats()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        got = {}
        eng.run(iter([Request(v, control, tag=i) for i, v in enumerate(vids)]), lambda req, res: got.__setitem__(req.tag, res))
        wall = time.perf_counter() - t0
        log = eng.stats["step_log"]
        pure = [r for r in log if r.branch_rows and not (r.prefill_tokens or r.plan_rows or r.layer_tokens)]
        full = [r.ms for r in pure if r.videos == n] or [r.ms for r in pure]
        key = n if graphs == "auto" else f"{n}_eager"
        tokens_by_mode[key] = {i: d.tokens for i, d in got.items() if not isinstance(d, Exception)}
        mode = {"ms_per_step": statistics.median(full) if full else None,
                "ms_per_step_over_floor": statistics.median(full) / out["floor_ms_per_step"] if full else None,
                "decode_tokens_per_s": sum(r.branch_rows for r in pure) / max(sum(r.ms for r in pure), 1e-9) * 1e3,
                "ms_per_video": wall * 1e3 / len(vids), "tokens": sum(len(t) for d in tokens_by_mode[key].values() for t in d),
                "steps": len(log), "kernel": eng.kernel.name, "graphs": eng.describe()["graphs"],
                "errors": sum(1 for d in got.values() if isinstance(d, Exception))}
        if args.device == "cuda":
            mode["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
            mode["kv_pool_gb"] = eng.pool.describe()["pool_gb"]
            mode["plan_predicted_gb"] = planned_bytes(model, eng, max(r.tokens for r in log)) / 1e9
        out["modes"][f"in_flight_{key}"] = mode
        out["kernel"] = eng.kernel.name
        del eng  # its KV pool goes before the next engine sizes its own
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for n in args.eager_at:  # the same mix without graphs: the graphs' gain per step, and the same tokens
        e, g = out["modes"][f"in_flight_{n}_eager"], out["modes"].get(f"in_flight_{n}") or out["modes"]["in_flight_1"]
        if e["ms_per_step"] and g["ms_per_step"]:
            e["eager_over_graphs_ms_per_step"] = e["ms_per_step"] / g["ms_per_step"]
        e["tokens_equal_graphs"] = tokens_by_mode[f"{n}_eager"] == tokens_by_mode.get(n, tokens_by_mode[1])
    base = out["modes"]["in_flight_1"]
    for n in args.in_flight:
        m = out["modes"][f"in_flight_{n}"]
        m["tokens_per_s_over_one"] = m["decode_tokens_per_s"] / max(base["decode_tokens_per_s"], 1e-9)
        same = {i: tokens_by_mode[n].get(i) == t for i, t in tokens_by_mode[1].items()}
        m["batched_equals_alone"] = all(same.values())
        if not m["batched_equals_alone"]:
            i = next(i for i, ok in same.items() if not ok)
            m["first_difference"] = first_difference(model, vids[i], control, cfg, tokens_by_mode[1][i],
                                                     tokens_by_mode[n].get(i) or [])
    return emit(out, args.out)


if __name__ == "__main__":
    main()
