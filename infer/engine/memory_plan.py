"""The memory plan: for a model and a device, how many videos of a given length fit in flight.

    python -m infer.engine.memory_plan --model DIR --device-memory-gb 24 --prefix-tokens 10000
    python -m infer.engine.memory_plan --model DIR --device-memory-gb 80 --prefix-tokens 2000,10000,32000 --json

The engine's KV pool (infer/engine/paged.py) is `kv_memory_fraction` of the device memory free
once the weights are loaded (or `infer.kv_memory_gb`), as the engine sizes it on CUDA; the
rest is the step's headroom, which must hold its working memory. A video is admitted only
when the pool can promise its worst case, so the figures here are exactly the engine's
admission rule (`worst_pages`, which the engine admits by; `videos_that_fit`, also used for /v1/model):

    worst pages = ceil((prefix + max_events) / page) + max_events * ceil(max_branch_tokens / page)

The weights are read off the checkpoint without loading it (tensor shapes and dtypes from
the safetensors headers, else the weight files' sizes at the dtype its config states),
converted to the decoding dtype; the caps are the checkpoint's (`max_planning_events`,
1 + `max_branch_tokens`) unless given. The step's working memory is an estimate (its largest
activations at `step_tokens`, the logits of `max_batch_rows` rows); 1 GB is set aside for the
CUDA context. `bench/gpu_check.sh` compares the plan with a measured peak.

Besides its KV pages a video in flight keeps state off the pool (`retained_bytes`: its prompt
embeddings, the grounding and aggregation layers' states over the prompt, its segment keys, its
encoded media tokens) and, while it is encoded, the towers' activations
(`encoder_bytes`); `video_peak` adds them up for one video of `VideoDims` (what
`bench/release_full_size.py` compares with a measured peak), and the table's headroom note
counts them for the videos that fit.
Pure python; no ray, no model load.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from infer.engine.kernels import FLEX_CUDA_CONTRACT
from infer.engine.paged import max_pages, pages_for

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4,
          "U8": 1, "I8": 1, "BOOL": 1}
CUDA_CONTEXT_GB = 1.0


@dataclass
class Shape:
    """What the plan needs of a decoder LM."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass
class Towers:
    """What the plan needs of the release's media towers (the published 3B's by default)."""

    vision_hidden: int = 1280
    vision_intermediate: int = 3420
    audio_width: int = 1280
    audio_ffn: int = 5120
    audio_heads: int = 20
    patch_values: int = 3 * 2 * 14 * 14  # one patch's pixel values (channels x temporal x 14 x 14)
    patches_per_token: int = 2 * 2  # the spatial merge: vision patches per LLM token
    audio_tokens_per_chunk: int = 60  # LLM tokens of one 30 s audio chunk (one per 0.5 s)


@dataclass
class VideoDims:
    """One video as the plan sizes it: prompt tokens, timesteps, vision-tower patches (T*H*W of its
    grid), 30 s audio chunks."""

    prefix: int
    timesteps: int
    patches: int = 0
    audio_chunks: int = 0


WHISPER_FRAMES = 1500  # encoder frames per chunk


def retained_bytes(shape: Shape, video: VideoDims, dtype_bytes: int, max_events: int = 30) -> int:
    """Bytes a video in flight keeps besides its KV pages: in the model dtype its prompt embeddings,
    the grounding and aggregation layers' states [L, d] each, the aggregation row [L] and its segment
    keys [T, d]; int64 M-RoPE ids [3, L], row limits, ids and token slots (about 6 L); fp32 planning
    similarities [K, T]; its media tokens as the encoder stage leaves them ([N / 4 + 60 C, d] in the
    model dtype, for N patches and C audio chunks: the pixels and log-mel are dropped once encoded).

    >>> retained_bytes(Shape(2, 8, 2, 1, 4, 16, 100), VideoDims(prefix=10, timesteps=2), 2, max_events=1)
    1020
    """
    model = (3 * video.prefix * shape.hidden + video.prefix + video.timesteps * shape.hidden) * dtype_bytes
    ints = 6 * video.prefix * 8  # ids [3, L], limits [L], input ids [L], token slots (< L)
    media = (video.patches // Towers.patches_per_token + video.audio_chunks * Towers.audio_tokens_per_chunk)
    return model + ints + media * shape.hidden * dtype_bytes + max_events * video.timesteps * 4


def encoder_bytes(towers: Towers, video: VideoDims, dtype_bytes: int) -> int:
    """The towers' largest live activations while a video is encoded (one tower at a time): the vision
    tower's pixels in the model dtype and a block's residual, norm, q/k/v, attention output and MLP
    (gate, up, product) over all N patches; Whisper's conv output, a layer's states and MLP and one
    layer's attention probabilities over the C chunks' 1500 frames."""
    vision = video.patches * (Towers.patch_values + 6 * towers.vision_hidden + 3 * towers.vision_intermediate)
    frames = video.audio_chunks * WHISPER_FRAMES
    audio = frames * (2 * 2 * towers.audio_width + 6 * towers.audio_width + 2 * towers.audio_ffn) + \
        frames * WHISPER_FRAMES * towers.audio_heads
    return max(vision, audio) * dtype_bytes


@dataclass
class VideoPeak:
    """One video's peak, by part (bytes): weights, KV at its worst case, retained state, and the larger of
    the encoders' and the step's working memory (they do not overlap)."""

    weights: int
    kv: int
    retained: int
    encoders: int
    working: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.retained + max(self.encoders, self.working)


def video_peak(shape: Shape, towers: Towers, weights_bytes: int, video: VideoDims, *, dtype_bytes: int = 2,
               page_size: int = 16, step_tokens: int = 512, rows: int = 128, max_events: int = 30,
               max_branch_tokens: int = 321) -> VideoPeak:
    """The memory one video needs decoded alone (module doc); page_size / step_tokens: the engine's
    CPU defaults (16 / 512), pass the CUDA ones (128 / 2048) for a GPU."""
    pages = worst_pages(video.prefix, max_events, max_branch_tokens, page_size)
    kv = pages * page_size * 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
    return VideoPeak(weights=weights_bytes, kv=kv, retained=retained_bytes(shape, video, dtype_bytes, max_events),
                     encoders=encoder_bytes(towers, video, dtype_bytes),
                     working=working_bytes(shape, step_tokens, min(rows, max_events), dtype_bytes))


@dataclass
class Plan:
    device_memory_gb: float
    weights_gb: float
    working_gb: float  # the step's working memory (estimate)
    headroom_gb: float  # what the pool leaves free for it
    kv_pool_gb: float
    kv_bytes_per_token: int
    page_size: int
    pages: int
    max_events: int
    max_branch_tokens: int
    videos_in_flight: dict[str, int]  # prefix tokens -> videos whose worst case fits at once
    live_kv_gb_per_video: dict[str, float]  # prefix tokens -> KV of its prefix alone
    retained_gb_per_video: dict[str, float]  # prefix tokens -> its state off the pool (no encoder inputs)

    def headroom_needed_gb(self) -> float:
        """The step's working memory plus the retained state of the most videos in flight at any prefix."""
        return self.working_gb + max([n * self.retained_gb_per_video[p] for p, n in self.videos_in_flight.items()],
                                     default=0.0)


def worst_pages(prefix: int, max_events: int, max_branch_tokens: int, page_size: int) -> int:
    """The pages the engine promises a video at admission (module doc)."""
    return pages_for(prefix + max_events, page_size) + max_events * pages_for(max_branch_tokens, page_size)


def videos_that_fit(pages: int, prefix: int, max_events: int, max_branch_tokens: int, page_size: int) -> int:
    """Videos of `prefix` tokens the pool (`pages`, one of them scratch) can hold in flight at once."""
    return max(0, (pages - 1) // worst_pages(prefix, max_events, max_branch_tokens, page_size))


def working_bytes(shape: Shape, step_tokens: int, rows: int, dtype_bytes: int) -> int:
    """The step's largest live activations (residual, norm, q/k/v, MLP up/gate at step_tokens) and
    the fp32 logits and scores of `rows` branch rows."""
    per_token = (4 * shape.hidden + 2 * shape.intermediate + 2 * shape.heads * shape.head_dim) * dtype_bytes
    return int(step_tokens * per_token + rows * shape.vocab * 8)


def plan(shape: Shape, weights_bytes: int, device_memory_gb: float, prefixes: list[int], *, dtype_bytes: int = 2,
         kv_fraction: float = 0.85, kv_memory_gb: float = 0.0, page_size: int = 128, step_tokens: int = 2048,
         rows: int = 128, max_events: int = 30, max_branch_tokens: int = 321) -> Plan:
    """The plan for one device size (module doc)."""
    working = working_bytes(shape, step_tokens, rows, dtype_bytes)
    free = max(0.0, device_memory_gb * 1e9 - weights_bytes - CUDA_CONTEXT_GB * 1e9)
    pool_bytes = kv_memory_gb * 1e9 if kv_memory_gb > 0 else free * kv_fraction
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes  # keys and values, every layer
    # the CUDA kernel (compiled flex) addresses a pool layer in int32: the engine caps its pool the same way
    pages = min(int(pool_bytes // (per_token * page_size)),
                max_pages(shape.kv_heads, shape.head_dim, page_size, FLEX_CUDA_CONTRACT.max_layer_elements))
    return Plan(device_memory_gb=device_memory_gb, weights_gb=round(weights_bytes / 1e9, 3), working_gb=round(working / 1e9, 3),
                headroom_gb=round((free - pages * per_token * page_size) / 1e9, 3),
                kv_pool_gb=round(pages * per_token * page_size / 1e9, 3), kv_bytes_per_token=per_token,
                page_size=page_size, pages=pages, max_events=max_events, max_branch_tokens=max_branch_tokens,
                videos_in_flight={str(p): videos_that_fit(pages, p, max_events, max_branch_tokens, page_size)
                                  for p in prefixes},
                live_kv_gb_per_video={str(p): round(p * per_token / 1e9, 3) for p in prefixes},
                retained_gb_per_video={str(p): round(retained_bytes(shape, VideoDims(p, 0), dtype_bytes, max_events) / 1e9, 4)
                                       for p in prefixes})


# ----------------------------------------------------------------------------------- checkpoints


def _safetensors_bytes(path: Path, target: int) -> int:
    """Bytes of the tensors in a safetensors file at `target` bytes per float element (header only)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        count = math.prod(t["shape"])
        size = _BYTES.get(t["dtype"], 4)
        total += count * (target if t["dtype"] in ("F32", "F16", "BF16", "F64") else size)
    return total


def checkpoint_caps(model_dir: Path) -> tuple[int | None, int | None]:
    """(max events, tokens per branch) a release checkpoint states, or None where it does not."""
    raw = json.loads((model_dir / "config.json").read_text())
    events, tokens = raw.get("max_planning_events"), raw.get("max_branch_tokens")
    return (int(events) if events else None), (int(tokens) + 1 if tokens else None)


def checkpoint_shape_and_weights(model_dir: Path, dtype_bytes: int) -> tuple[Shape, int]:
    """(decoder shape, weight bytes at dtype_bytes per float) of a checkpoint directory with an HF
    config.json, without loading any tensor."""
    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    text = raw.get("text_config") or raw
    if "hidden_size" not in text:  # e.g. a saved PadCaptioner's run Config
        raise SystemExit(f"{cfg_path}: not an HF model config (no hidden_size); pass a release checkpoint "
                         f"directory, or --shape")
    heads = int(text["num_attention_heads"])
    shape = Shape(layers=int(text["num_hidden_layers"]), hidden=int(text["hidden_size"]), heads=heads,
                  kv_heads=int(text.get("num_key_value_heads", heads)),
                  head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
                  intermediate=int(text["intermediate_size"]), vocab=int(text.get("vocab_size", raw.get("vocab_size", 0))))
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return shape, sum(_safetensors_bytes(f, dtype_bytes) for f in files)
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise SystemExit(f"{model_dir}: no model.safetensors / pytorch_model.bin to size the weights")
    stored = _BYTES.get(str(raw.get("torch_dtype") or text.get("torch_dtype") or "float32"), 4)
    return shape, int(sum(f.stat().st_size for f in bins) * dtype_bytes / stored)


def checkpoint_towers(model_dir: Path) -> Towers:
    """The media towers' widths a release checkpoint's config.json states (the 3B's where absent)."""
    raw = json.loads((model_dir / "config.json").read_text())
    v, a, d = raw.get("vision_config") or {}, raw.get("audio_config") or {}, Towers()
    return Towers(vision_hidden=int(v.get("hidden_size", d.vision_hidden)),
                  vision_intermediate=int(v.get("intermediate_size", d.vision_intermediate)),
                  audio_width=int(a.get("d_model", d.audio_width)),
                  audio_ffn=int(a.get("encoder_ffn_dim", d.audio_ffn)),
                  audio_heads=int(a.get("encoder_attention_heads", d.audio_heads)))


SHAPES = {  # known shapes (no checkpoint needed): (LLM shape, parameters the decoding process holds)
    # the published release: Qwen2.5-VL-3B LLM + its vision tower, Whisper-large-v3 encoder and the
    # window Q-Former, 4.7 B parameters in all
    "release-3b": (Shape(36, 2048, 16, 2, 128, 11008, 151936), int(4.7e9)),
    "qwen2.5-0.5b": (Shape(24, 896, 14, 2, 64, 4864, 151936), int(0.494e9)),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a release checkpoint directory (config.json + weights)")
    src.add_argument("--shape", choices=sorted(SHAPES), help="a known model shape instead of a checkpoint")
    ap.add_argument("--device-memory-gb", type=float, nargs="+", default=[24.0])
    ap.add_argument("--prefix-tokens", default="2000,10000,32000", help="comma-separated prefix lengths")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--max-events", type=int, default=0, help="0 = the checkpoint's (else 30)")
    ap.add_argument("--max-branch-tokens", type=int, default=0, help="0 = the checkpoint's (1 + its max_branch_tokens; else 321)")
    ap.add_argument("--page-size", type=int, default=128, help="keys per page (the engine's CUDA default: 128)")
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=128, help="infer.max_batch_rows")
    ap.add_argument("--kv-fraction", type=float, default=0.85)
    ap.add_argument("--kv-memory-gb", type=float, default=0.0, help="a fixed pool instead of the fraction")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dtype_bytes = _BYTES[args.dtype]
    events, tokens = None, None
    if args.model:
        shape, weights = checkpoint_shape_and_weights(args.model.expanduser(), dtype_bytes)
        events, tokens = checkpoint_caps(args.model.expanduser())
    else:
        shape, params = SHAPES[args.shape]
        weights = params * dtype_bytes
    args.max_events = args.max_events or events or 30
    args.max_branch_tokens = args.max_branch_tokens or tokens or 321
    prefixes = [int(x) for x in args.prefix_tokens.split(",") if x]
    plans = [plan(shape, weights, gb, prefixes, dtype_bytes=dtype_bytes, kv_fraction=args.kv_fraction,
                  kv_memory_gb=args.kv_memory_gb, page_size=args.page_size, step_tokens=args.step_tokens, rows=args.rows,
                  max_events=args.max_events, max_branch_tokens=args.max_branch_tokens) for gb in args.device_memory_gb]
    out = {"shape": asdict(shape), "dtype": args.dtype, "plans": [asdict(p) for p in plans]}
    if args.json:
        print(json.dumps(out, indent=2))
        return out
    print(f"LLM: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads / {shape.kv_heads} KV heads of "
          f"{shape.head_dim}; {args.dtype}; KV {plans[0].kv_bytes_per_token / 1024:.0f} KiB per token")
    print(f"caps: {args.max_events} events x {args.max_branch_tokens} tokens; pages of {args.page_size}; "
          f"a video is admitted when its worst case fits")
    head = "device GB  weights GB  KV pool GB  headroom GB  working GB  " + "  ".join(f"videos@{p}" for p in prefixes)
    print(head)
    for p in plans:
        cols = "  ".join(f"{p.videos_in_flight[str(x)]:>{len(f'videos@{x}')}}" for x in prefixes)
        print(f"{p.device_memory_gb:>9.0f}  {p.weights_gb:>10.2f}  {p.kv_pool_gb:>10.2f}  {p.headroom_gb:>11.2f}  "
              f"{p.working_gb:>10.2f}  {cols}")
        if p.headroom_gb < p.headroom_needed_gb():
            print(f"  note: at {p.device_memory_gb:.0f} GB the headroom is below the step's working memory and the "
                  f"videos' retained state ({p.headroom_needed_gb():.2f} GB): lower infer.kv_memory_fraction, "
                  f"infer.step_tokens or infer.max_batch_videos")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
