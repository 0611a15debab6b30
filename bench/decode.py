"""Decode benchmark: the engine against the single chain, one branch at a time, and the copied prefix.

Same weights (random init, no download), same prefix, same forced branch lengths
(<eos> suppressed until each branch's length, so every mode generates the same
tokens), side by side in one run, modes interleaved per repeat:

  monolithic         one causal chain, HF DynamicCache (infer/oracles/decoders.py)   sum(len) steps
  branch_sequential  the factorized model, one branch after another            sum(len) steps
  parallel_copy      K rows in lock-step, prefix KV copied per branch, masked
                     SDPA, finished rows kept (the public release's way)       max(len) steps
  engine             infer/engine/core.py: cascade attention, shared prefix read
                     once, finished branches dropped                           max(len) steps

Prints JSON: per mode the wall time per video (prefill + planning + grounding +
decode), the decode time, ms per generated token, ms per decode step, steps, and the
ratio to monolithic; the ideal step ratio sum(len) / max(len); the memory-bandwidth
floor per step (bytes of the weights read per step + KV bytes, over the bandwidth:
docs/design/method.md section 4); the roofline per step of the engine and the single chain
(bytes over the bandwidth or FLOPs over the measured GEMM peak, whichever is larger,
for the linear layers and for the attention), the speedup it allows on this device, and
how far each decoder runs above it; and the targets.

Presets
  cpu-small      (default) a small Qwen2 shape (hidden 512, 8 layers, 8/2 heads,
                 fp32, ~100 MB of weights: memory-bound-ish on CPU), prefix 2048,
                 K = 8, 32 tokens per branch
  qwen2.5-0.5b   the real 0.5B shape (prefix 2048, K = 8, 32 tokens)
  qwen2.5-3b     the real 3B shape, for GPUs

Run:
  .venv/bin/python -m bench.decode                                  # cpu-small, < 3 min on 2 cores
  python -m bench.decode --preset qwen2.5-3b --device cuda --dtype bfloat16 [--out r.json] [--png r.png]
  options: --prefix N --events K --tokens N | --lengths 4,32,8,... --repeats R --threads T
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from infer.engine.core import CaptionEngine
from infer.engine.sampling import DecodeControl
from infer.oracles.decoders import branch_sequential, monolithic, parallel_copy
from pipeline import backbone as backbone_mod
from pipeline.config import InferConfig, ModelConfig
from pipeline.schema import Sample

MODES = ("monolithic", "branch_sequential", "parallel_copy", "engine")
BENCH_BACKBONE = "bench-small"
# a bench-only Qwen2 shape (registered as a backbone preset at run time)
BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, rope_theta=1000000.0, vocab_size=None)
# practical HBM bandwidth (GB/s) by device name; docs/design/method.md section 4
KNOWN_BANDWIDTH = {"H200": 4300.0, "H100": 3000.0, "A100": 1700.0, "A6000": 770.0, "L40S": 800.0, "L4": 270.0}
DV, DA, V_TOKENS, A_TOKENS = 32, 16, 6, 2


@dataclass
class Preset:
    backbone: str
    device: str = "cpu"
    dtype: str = "float32"
    prefix: int = 2048
    events: int = 8
    tokens: int = 32
    repeats: int = 3
    budget_s: float = 150.0  # no further repeat once it would end past this many seconds of timing


PRESETS = {
    "cpu-small": Preset(BENCH_BACKBONE, budget_s=110.0),
    "qwen2.5-0.5b": Preset("qwen2.5-0.5b", repeats=2),
    "qwen2.5-3b": Preset("qwen2.5-3b", device="cuda", dtype="bfloat16", repeats=5, budget_s=100.0),
}


# --------------------------------------------------------------------------- set-up


def build_model(preset: Preset, device: torch.device, max_len: int, segments: int):
    """PadCaptioner with a random-init backbone of the preset's shape on `device` (LoRA merged)."""
    from pipeline.model import PadCaptioner

    backbone_mod.PRESETS.setdefault(BENCH_BACKBONE, BENCH_SHAPE)
    cfg = ModelConfig(backbone=preset.backbone, tokenizer="bpe", dtype=preset.dtype, visual_dim=DV, audio_dim=DA,
                      max_seq_len=max_len, max_segments=max(512, segments + 1))
    if device.type == "cuda":
        try:  # initialise on the GPU: random init of billions of weights on one CPU thread takes minutes
            with torch.device(device):
                model = PadCaptioner(cfg)
        except Exception as e:  # noqa: BLE001 - fall back to the plain path, say so
            print(f"note: building on {device} failed ({type(e).__name__}: {e}); building on CPU", file=sys.stderr)
            model = PadCaptioner(cfg)
    else:
        model = PadCaptioner(cfg)
    model = model.to(device).eval()
    model.backbone.merge_adapter()  # serving-style: LoRA folded into the weights, no extra matmuls per step
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def make_sample(model, prefix: int, seed: int = 0) -> Sample:
    """Random features with T segments chosen so the prefix has about `prefix` tokens."""
    text = len(model.prompt[0]) + len(model.prompt[1])
    t = max(1, (prefix - text) // (V_TOKENS + A_TOKENS))
    rng = np.random.default_rng(seed)
    times = np.stack([np.arange(t), np.arange(t) + 1], 1).astype(np.float32)
    return Sample(video_id="bench", duration=float(t), segment_times=times,
                  visual=rng.standard_normal((t, V_TOKENS, DV)).astype(np.float16),
                  audio=rng.standard_normal((t, A_TOKENS, DA)).astype(np.float16), has_audio=True)


def weight_bytes(model) -> int:
    """Bytes of backbone weights one decode step reads (LoRA merged; an untied input table is only gathered)."""
    base = model.backbone.get_base_model()
    in_w, out_w = base.get_input_embeddings().weight, base.get_output_embeddings().weight
    skip = {id(in_w)} if in_w.data_ptr() != out_w.data_ptr() else set()
    seen, total = set(), 0
    for name, p in base.named_parameters():
        if "lora_" in name or id(p) in skip or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(model) -> int:
    c = model.hf_config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * _head_dim(c) * torch.finfo(model.dtype).bits // 8


@dataclass(frozen=True)
class StepWork:
    """What one decode step touches: query rows, KV tokens read, visible keys summed over the rows."""

    rows: int
    kv_read: int
    keys_seen: int


def decode_steps(lengths: list[int], shared_len: int) -> tuple[list[StepWork], list[StepWork]]:
    """The steps of the engine and of the single chain for branches of `lengths` after `shared_len` tokens.

    Engine step j: n active branches, the shared KV read once plus each branch's own j + 1
    tokens; every row sees the shared prefix and its own j + 1 tokens. Chain step i: one
    row that reads and sees everything before it.
    """
    engine = []
    for j in range(max(lengths)):
        n = sum(1 for ln in lengths if ln > j)
        engine.append(StepWork(n, shared_len + n * (j + 1), n * (shared_len + j + 1)))
    chain = [StepWork(1, shared_len + i + 1, shared_len + i + 1) for i in range(sum(lengths))]
    return engine, chain


def floors(model, lengths: list[int], shared_len: int, bandwidth_gbs: float | None) -> dict:
    """Bandwidth floor per step (ms): weights + the KV each step must read, averaged over the steps."""
    w, kv = weight_bytes(model), kv_bytes_per_token(model)
    engine, chain = ([w + s.kv_read * kv for s in steps] for steps in decode_steps(lengths, shared_len))
    out = {"weight_bytes": w, "kv_bytes_per_token": kv, "bandwidth_gbs": bandwidth_gbs,
           "engine_bytes_per_step": statistics.mean(engine), "monolithic_bytes_per_step": statistics.mean(chain)}
    if bandwidth_gbs:
        to_ms = lambda b: b / (bandwidth_gbs * 1e9) * 1e3  # noqa: E731
        out.update(floor_ms_per_step=to_ms(statistics.mean(engine)),
                   floor_ms_per_token=to_ms(sum(engine)) / sum(lengths),
                   monolithic_floor_ms_per_step=to_ms(statistics.mean(chain)))
    return out


def roofline(model, lengths: list[int], shared_len: int, bandwidth_gbs: float, peak_gflops: float) -> dict:
    """Roofline time per step (ms) of each decoder, and the speedup it allows the engine.

    A step is two kinds of work, each bounded by max(bytes / bandwidth, FLOPs / peak):
    the linear layers (the weights read once, 2 FLOPs per weight per query row) and
    the attention (the KV it reads, 4 * Hq * D FLOPs per query row and visible key per
    layer). A K-row engine step reads the weights once but does K rows of arithmetic, so
    where the peak FLOP rate is low against the bandwidth (a CPU core) the K rows are
    not free, and `speedup_bound` = ideal step ratio x monolithic / engine roofline
    falls below the ideal; where they are (a GPU) it is the ideal.
    """
    c = model.hf_config
    w, kv = weight_bytes(model), kv_bytes_per_token(model)
    lin_flops_per_row = 2 * w / model.dtype.itemsize
    attn_flops_per_key = 4 * c.num_attention_heads * _head_dim(c) * c.num_hidden_layers  # one query row, one key
    bw, peak = bandwidth_gbs * 1e9, peak_gflops * 1e9

    def step_ms(s: StepWork) -> float:
        lin = max(w / bw, s.rows * lin_flops_per_row / peak)
        attn = max(s.kv_read * kv / bw, s.keys_seen * attn_flops_per_key / peak)
        return (lin + attn) * 1e3

    eng, mono = (statistics.mean(map(step_ms, steps)) for steps in decode_steps(lengths, shared_len))
    ideal = sum(lengths) / max(lengths)
    return {"peak_gflops": round(peak_gflops, 1), "machine_balance_flop_per_byte": round(peak / bw, 1),
            "engine_ms_per_step": round(eng, 3), "monolithic_ms_per_step": round(mono, 3),
            "speedup_bound": round(ideal * mono / eng, 3)}


def measure_peak_gflops(device: torch.device, dtype: torch.dtype) -> float:
    """Matmul throughput in GFLOP/s for `dtype` on `device` (the best of a few square GEMMs)."""
    cuda = device.type == "cuda"
    n, reps = (4096, 4) if cuda else (1024, 1)  # GPU: several GEMMs per timing, launch and sync amortised
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    del a, b
    return 2 * n**3 / min(times[1:]) / 1e9


def measure_bandwidth(device: torch.device, mb: int = 512) -> float:
    """Copy bandwidth in GB/s (read + write bytes), median of a few copies."""
    n = mb * 1024 * 1024 // 4
    a, b = torch.empty(n, device=device), torch.empty(n, device=device)
    a.fill_(1.0)
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n * 4 / statistics.median(times[1:]) / 1e9


# --------------------------------------------------------------------------- timing


def run_modes(model, sample, cfg: InferConfig, control: DecodeControl, modes, repeats: int, budget_s: float) -> dict:
    engine = CaptionEngine(model, cfg)
    fns = {"monolithic": lambda s, ctl: monolithic(model, s, cfg, ctl),
           "branch_sequential": lambda s, ctl: branch_sequential(model, s, cfg, ctl),
           "parallel_copy": lambda s, ctl: parallel_copy(model, s, cfg, ctl),
           "engine": lambda s, ctl: engine.decode(s, ctl)}
    warm = make_sample(model, 256, seed=1)
    for name in modes:  # warm-up on a short video with 2-token branches: kernels, allocator, first calls
        fns[name](warm, replace(control, lengths=[2]))
    runs = {name: [] for name in modes}
    errors = {}
    t_start = time.perf_counter()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **k: x  # noqa: E731
    for r in tqdm(range(repeats), desc="repeats", file=sys.stderr):
        order = list(modes[r % len(modes):]) + list(modes[: r % len(modes)])  # rotate: load hits all alike
        for name in order:
            if name in errors:
                continue
            try:
                runs[name].append(fns[name](sample, control))
            except Exception as e:  # noqa: BLE001 - report the mode's failure, keep the others
                errors[name] = f"{type(e).__name__}: {e}"
        elapsed = time.perf_counter() - t_start
        if elapsed * (r + 2) / (r + 1) > budget_s:  # the next repeat would overrun the time budget
            break
    return {"runs": runs, "errors": errors}


def summarise(runs: dict, errors: dict, lengths: list[int]) -> dict:
    ideal = sum(lengths) / max(lengths)
    out = {}
    ref_tokens = runs["engine"][0].tokens if runs.get("engine") else None
    for name, decs in runs.items():
        if not decs:
            out[name] = {"error": errors.get(name, "no run")}
            continue
        decode = statistics.median(d.timings["decode_ms"] for d in decs)
        total = statistics.median(d.timings["total_ms"] for d in decs)
        d0 = decs[0]
        out[name] = {"wall_ms_per_video": round(total, 2), "decode_ms": round(decode, 2),
                     "ms_per_token": round(decode / d0.num_tokens, 3), "ms_per_step": round(decode / d0.steps, 3),
                     "steps": d0.steps, "tokens": d0.num_tokens, "repeats": len(decs),
                     "prefill_ms": round(statistics.median(d.timings["prefill_ms"] for d in decs), 2)}
        if name != "monolithic" and ref_tokens is not None:
            out[name]["tokens_equal_engine"] = d0.tokens == ref_tokens
    if "monolithic" in out and "decode_ms" in out["monolithic"]:
        mono = out["monolithic"]
        for name, row in out.items():
            if "decode_ms" in row:
                row["speedup_vs_monolithic"] = round(mono["decode_ms"] / row["decode_ms"], 3)
                row["wall_speedup_vs_monolithic"] = round(mono["wall_ms_per_video"] / row["wall_ms_per_video"], 3)
    targets = {"ideal_step_ratio": round(ideal, 3), "engine_min_speedup": round(0.8 * ideal, 3)}
    eng, copy = out.get("engine", {}), out.get("parallel_copy", {})
    if "speedup_vs_monolithic" in eng:
        targets["engine_speedup_met"] = eng["speedup_vs_monolithic"] >= 0.8 * ideal
        targets["engine_fraction_of_ideal"] = round(eng["speedup_vs_monolithic"] / ideal, 3)
    mono = out.get("monolithic", {})
    if "ms_per_step" in eng and "ms_per_step" in mono:  # speedup = ideal_step_ratio / this
        targets["engine_step_cost_over_monolithic_step"] = round(eng["ms_per_step"] / mono["ms_per_step"], 3)
    if "ms_per_step" in eng and "ms_per_step" in copy:
        targets["engine_faster_per_step_than_parallel_copy"] = eng["ms_per_step"] < copy["ms_per_step"]
        targets["parallel_copy_over_engine_per_step"] = round(copy["ms_per_step"] / eng["ms_per_step"], 3)
    return {"modes": out, "targets": targets}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m, r in result["modes"].items() if "ms_per_token" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    vals = [result["modes"][m]["ms_per_token"] for m in modes]
    ax.bar(modes, vals, color=["#999", "#b88", "#88b", "#4a4"][: len(modes)])
    if result["floor"].get("floor_ms_per_token"):
        ax.axhline(result["floor"]["floor_ms_per_token"], color="k", ls="--", lw=1, label="bandwidth floor (engine)")
        ax.legend()
    ax.set_ylabel("decode ms per generated token")
    ax.set_title(f"{result['preset']} on {result['device_name']}: K={result['events']}, prefix {result['prefix_len']}")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    ap.add_argument("--device", default=None, help="cpu | cuda (default: the preset's)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prefix", type=int, default=None, help="prefix tokens (about)")
    ap.add_argument("--events", type=int, default=None, help="K branches")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per branch (all equal)")
    ap.add_argument("--lengths", default="", help="comma-separated branch lengths (overrides --events/--tokens)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kernel", default="auto", choices=["auto", "sdpa", "flex", "reference"],
                    help="the decode step's attention kernel (infer/engine/kernels.py)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = 1 on CPU, torch default on CUDA)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the floor (default: known GPU, else measured)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--png", default="", help="bar chart of ms per token")
    args = ap.parse_args(argv)

    preset = PRESETS[args.preset]
    preset = replace(preset, **{k: v for k, v in dict(device=args.device, dtype=args.dtype, prefix=args.prefix,
                                                      events=args.events, tokens=args.tokens,
                                                      repeats=args.repeats).items() if v is not None})
    # CPU: one thread unless asked. On shared 2-core boxes an oversubscribed OpenMP team stalls the
    # batched GEMMs of the K-row steps (measured 10-50x slower), which would bench the scheduler, not decoding.
    threads = args.threads or (1 if preset.device == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    if preset.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    device = torch.device(preset.device)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [preset.tokens] * preset.events
    k = len(lengths)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)} (modes: {MODES})")

    torch.manual_seed(0)
    t0 = time.perf_counter()
    segments = preset.prefix // (V_TOKENS + A_TOKENS) + 1
    model = build_model(preset, device, max_len=preset.prefix + k + max(lengths) + 256, segments=segments)
    build_s = time.perf_counter() - t0
    sample = make_sample(model, preset.prefix)
    prefix_len = len(model.make_example(sample, with_targets=False).layout)
    cfg = InferConfig(device=preset.device, max_events=k, max_branch_tokens=max(lengths),
                      kernel=args.kernel)
    control = DecodeControl(num_events=k, lengths=lengths)
    with torch.inference_mode():
        timed = run_modes(model, sample, cfg, control, modes, preset.repeats, preset.budget_s)
    result = summarise(timed["runs"], timed["errors"], lengths)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = args.bandwidth_gbs or next((v for key, v in KNOWN_BANDWIDTH.items() if key in name), None)
    measured = measure_bandwidth(device)
    floor = floors(model, lengths, prefix_len + k, bw or measured)
    floor["bandwidth_source"] = "given" if args.bandwidth_gbs else ("known device" if bw else "measured copy")
    floor["measured_copy_gbs"] = round(measured, 1)
    eng = result["modes"].get("engine", {})
    if floor.get("floor_ms_per_step") and "ms_per_step" in eng:
        floor["engine_ms_per_step_over_floor"] = round(eng["ms_per_step"] / floor["floor_ms_per_step"], 2)
    roof = roofline(model, lengths, prefix_len + k, bw or measured, measure_peak_gflops(device, model.dtype))
    for mode, key in (("engine", "engine_ms_per_step"), ("monolithic", "monolithic_ms_per_step")):
        if "ms_per_step" in result["modes"].get(mode, {}):  # how far each decoder runs from its own roofline
            roof[f"{mode}_measured_over_roofline"] = round(result["modes"][mode]["ms_per_step"] / roof[key], 2)
    c = model.hf_config
    out = {"preset": args.preset, "device": str(device), "device_name": name, "dtype": preset.dtype,
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "model": {"backbone": preset.backbone, "layers": c.num_hidden_layers, "hidden": c.hidden_size,
                     "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "vocab": c.vocab_size,
                     "weight_bytes": floor["weight_bytes"]},
           "prefix_len": prefix_len, "events": k, "lengths": lengths, "build_s": round(build_s, 1),
           **result, "floor": floor, "roofline": roof}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.png:
        plot(out, args.png)
    return out


if __name__ == "__main__":
    main()
