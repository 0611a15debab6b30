"""The published PadCaptioner-3B at its real size on this machine: build, load, caption one mp4, plan vs peak.

    nice -n 10 python -m bench.release_full_size --out bench/results/release_full_size.json
    python -m bench.release_full_size --scale ci --cache /tmp/rfs --out /tmp/rfs/r.json --seconds 4   # tests

The weights are not downloadable here, so the checkpoint is random, but everything else is the
release's: its configuration (`release_config`), its key names and its on-disk format (one bf16
`pytorch_model.bin` written by `torch.save`, tied `lm_head.weight` left out, the Q-Former's int64
`position_ids` buffer and the unused `score_head.*` kept, next to `config.json` and the tokenizer).
It is built once into `--cache` (about 9.4 GB at full scale) from a model constructed on the meta
device, each tensor filled in place in a file-backed scratch map, so building never holds the
weights in anonymous memory, let alone twice. `--scale ci` is the same configuration with tiny
widths and depths (same keys, same structure) for the test suite.

The measurement runs in a fresh process: the offline captioning command's two stages in this
process (infer/offline/job.py `FeaturizeForCaption`, the release's media preparation, and
`CaptionVideos`, which loads the checkpoint with infer/loading.py and captions with the engine),
without Ray, on the CPU in bf16, for one rendered mp4 with audio (`--seconds`, `--size`). It writes
`checkpoint_bytes`; `load_s` (the loader; the model id's weights hash before it is `fingerprint_s`, 0 once cached);
`peak_rss_over_checkpoint` ((peak RSS once every weight was read - RSS before the load) / file size,
target <= 1.3); `measured_peak_bytes` (peak RSS over the whole caption - RSS before the load) next to
`plan_predicted_bytes` (infer/engine/memory_plan.py `video_peak` for this video: weights, its KV worst
case, retained state, encoder activations; target within 15 %) and `plan` (the plan's table for a
device of this machine's RAM); `stage_s` (vision tower, audio tower, prefill, planning, decoding);
`av_tokens`, `events`, `tokens_per_s`, and `captioned` (the row is ok). The caps are the
checkpoint's (30 events, 1 + 320 tokens a branch).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.output import command, emit

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "release_golden" / "checkpoint"  # the release's tokenizer and config layout
BIN = "pytorch_model.bin"


def release_config(scale: str = "full") -> dict:
    """The release's config.json at `scale`: "full" is the published PadCaptioner-3B's, "ci" the same
    structure with tiny widths and depths.

    Full: the Qwen2.5-VL-3B LLM (hidden 2048, MLP 11008, 36 layers, 16 query heads and 2 KV heads of
    128, M-RoPE sections [16, 24, 24] of the 64 rotary frequencies, rope theta 1e6, tied embeddings
    of 151936 rows); its vision tower (32 blocks of width 1280, 16 heads, MLP 3420, 14 px patches, 2
    frames a patch, 2x2 merge, windows of 112 px with full attention in blocks 7, 15, 23 and 31, a
    merger to 2048, 2 position ids a second); Whisper-large-v3's encoder (32 layers of width 1280, 20
    heads, MLP 5120, 128 mel bins, 1500 frames a 30 s chunk); the window Q-Former with BERT's defaults
    (width 3072, 2 layers, 12 heads, MLP 12288, cross-attention to the 1280-wide Whisper frames in every
    layer, one query per 0.5 s window) and its projection to 2048; the grounding heads; the evidence
    fields of the shipped setting (aggregation at layer 6, audio mean weight 1) and the release code's
    caps (30 planned events, 320 tokens a branch after the first).

    >>> full, ci = release_config("full"), release_config("ci")
    >>> full["num_hidden_layers"], full["vision_config"]["fullatt_block_indexes"], ci["num_hidden_layers"]
    (36, [7, 15, 23, 31], 4)
    >>> sorted(full) == sorted(ci) and full["audio_config"].keys() == ci["audio_config"].keys()
    True
    """
    cfg = json.loads((FIXTURE / "config.json").read_text())
    full = scale == "full"
    llm = (2048, 11008, 36, 16, 2) if full else (64, 176, 4, 4, 2)
    hidden = llm[0]
    cfg.update(hidden_size=hidden, intermediate_size=llm[1], num_hidden_layers=llm[2], num_attention_heads=llm[3],
               num_key_value_heads=llm[4], vision_audio_layer_index=6 if full else 2, max_planning_events=30,
               max_branch_tokens=320, torch_dtype="bfloat16")
    cfg["rope_scaling"] = {**cfg["rope_scaling"], "mrope_section": [16, 24, 24] if full else [2, 3, 3]}
    vision = (32, 1280, 16, 3420, [7, 15, 23, 31]) if full else (4, 32, 2, 48, [1, 3])
    cfg["vision_config"].update(depth=vision[0], hidden_size=vision[1], num_heads=vision[2], intermediate_size=vision[3],
                                fullatt_block_indexes=vision[4], out_hidden_size=hidden, window_size=112,
                                tokens_per_second=2)
    whisper = (1280, 32, 20, 5120) if full else (32, 2, 2, 64)
    cfg["audio_config"].update(d_model=whisper[0], encoder_layers=whisper[1], num_hidden_layers=whisper[1],
                               encoder_attention_heads=whisper[2], encoder_ffn_dim=whisper[3])
    qformer = (3072, 2, 12, 12288) if full else (48, 2, 2, 96)
    cfg["audio_config"]["qformer_config"].update(hidden_size=qformer[0], num_hidden_layers=qformer[1],
                                                 num_attention_heads=qformer[2], intermediate_size=qformer[3],
                                                 encoder_width=whisper[0], out_hidden_size=hidden)
    return cfg


# ----------------------------------------------------------------------------- building the checkpoint


def _extra_tensors(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the release saves that the model leaves out: the Q-Former's position ids and the unused score head."""
    d = cfg["hidden_size"]
    q = cfg["audio_config"]["qformer_config"]
    return {"audio.qformer.bert.embeddings.position_ids": ((1, q["max_position_embeddings"]), "int64"),
            "score_head.0.weight": ((d,), "ones"), "score_head.0.bias": ((d,), "zeros"),
            "score_head.1.weight": ((d // 2, d), "normal"), "score_head.1.bias": ((d // 2,), "zeros"),
            "score_head.3.weight": ((1, d // 2), "normal"), "score_head.3.bias": ((1,), "zeros")}


def _init_kind(key: str, shape: tuple[int, ...]) -> str:
    """How a random release tensor is filled: norms' scales ones, biases zeros, the rest N(0, 0.02)."""
    if len(shape) == 1 and any(n in key for n in ("norm", "LayerNorm", "ln_q")):
        return "ones" if key.endswith("weight") else "zeros"
    return "zeros" if key.endswith("bias") else "normal"


def _fill(t, kind: str, seed: int) -> None:
    """Fill tensor `t` in place (N(0, 0.02) in chunks: the fp32 temporaries stay small)."""
    import torch

    if kind == "int64":
        t.copy_(torch.arange(t.shape[-1]).expand_as(t))
    elif kind in ("ones", "zeros"):
        t.fill_(1.0 if kind == "ones" else 0.0)
    else:
        gen = torch.Generator().manual_seed(seed)
        flat = t.view(-1)
        for lo in range(0, flat.numel(), 1 << 24):
            part = flat[lo: lo + (1 << 24)]
            part.copy_(torch.randn(part.numel(), generator=gen).mul_(0.02))


def release_layout(out: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{release key: (shape, fill kind)} of the checkpoint in `out` (config and tokenizer written), from a
    model built on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.release.model import ReleaseCaptioner, ReleaseSettings

    with init_empty_weights(include_buffers=False):
        model = ReleaseCaptioner(AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out),
                                 ReleaseSettings(dtype="bfloat16"))
    state = model.release_state_dict()
    not_float = [k for k, t in state.items() if not t.is_floating_point()]
    if not_float:
        raise ValueError(f"the model has tensors this builder cannot fill: {not_float[:4]}")
    names = {k: (tuple(t.shape), _init_kind(k, tuple(t.shape))) for k, t in state.items()}
    return {**names, **_extra_tensors(json.loads((out / "config.json").read_text()))}


def write_random_bin(out: Path, layout: dict[str, tuple[tuple[int, ...], str]], scratch: Path) -> int:
    """torch.save a random bf16 state dict of `layout` to out/pytorch_model.bin -> its parameter count. Each
    tensor is its own storage over a file-backed scratch map (written pages go to disk, not to anonymous memory)."""
    import numpy as np
    import torch

    sizes = {k: int(np.prod(shape)) * (8 if kind == "int64" else 2) for k, (shape, kind) in layout.items()}
    scratch.write_bytes(b"")
    with scratch.open("r+b") as f:
        f.truncate(sum(sizes.values()))
    state, offset = {}, 0
    for i, (key, (shape, kind)) in enumerate(layout.items()):
        np_dtype = np.int64 if kind == "int64" else np.int16
        mapped = np.memmap(scratch, dtype=np_dtype, mode="r+", offset=offset, shape=(int(np.prod(shape)),))
        t = torch.from_numpy(mapped)
        t = (t if kind == "int64" else t.view(torch.bfloat16)).view(shape)
        _fill(t, kind, seed=i)
        state[key] = t
        offset += sizes[key]
    torch.save(state, out / BIN)
    return sum(t.numel() for k, t in state.items() if t.is_floating_point())


def build_checkpoint(cache: Path, scale: str) -> tuple[Path, dict]:
    """The release directory for `scale` under `cache`, built unless a complete one with this config is there."""
    cfg = release_config(scale)
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    out = cache / f"release-{scale}-{key}"
    marker = out / "built.json"
    if marker.is_file():
        return out, {**json.loads(marker.read_text()), "built_now": False}
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".building-{scale}-", dir=cache))
    try:
        for f in FIXTURE.iterdir():
            if f.name != BIN:
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        scratch = cache / f".scratch-{scale}-{os.getpid()}"
        try:
            params = write_random_bin(tmp, release_layout(tmp), scratch)
        finally:
            scratch.unlink(missing_ok=True)
        info = {"scale": scale, "parameters": params, "build_s": round(time.perf_counter() - t0, 1)}
        (tmp / "built.json").write_text(json.dumps(info))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, {**info, "built_now": True}


def render_video(path: Path, seconds: float, size: int) -> Path:
    """A real H.264 + AAC mp4: a moving square at 8 fps, a tone that changes pitch halfway."""
    import numpy as np

    from bench.mp4 import moving_square, tone, write_mp4

    n = int(seconds * 8)
    half = tone(330, seconds / 2)
    audio = np.concatenate([half, tone(660, seconds - half.shape[0] / 44100)])
    return write_mp4(path, moving_square(n, size, size, dx=1, dy=1), fps=8, audio=audio)


# ----------------------------------------------------------------------------- measuring (fresh process)


def status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (this process image's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def _say(what: str, **figures) -> None:
    """A progress line on stderr (a run that dies midway leaves what it did)."""
    print(json.dumps({"stage": what, "rss": status_bytes("VmRSS"), "peak": status_bytes("VmHWM"), **figures}),
          file=sys.stderr, flush=True)


def _timed(fn, sink: list[float]):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)
    return run


def _touch_weights(model) -> float:
    """Read every weight once (the file is mapped lazily), in chunks -> a checksum."""
    import torch

    with torch.no_grad():
        return sum(float(c.sum(dtype=torch.float32)) for t in model.state_dict().values() if t.is_floating_point()
                   for c in t.reshape(-1).split(1 << 22))


def _plan(ckpt: Path, engine, video_dims, box_gb: float) -> dict:
    """The memory plan's prediction for this video, and its table for a device of `box_gb`."""
    from dataclasses import asdict

    from infer.engine.memory_plan import checkpoint_shape_and_weights, checkpoint_towers, plan, video_peak

    shape, weights = checkpoint_shape_and_weights(ckpt, 2)
    c = engine.cfg
    peak = video_peak(shape, checkpoint_towers(ckpt), weights, video_dims, page_size=engine.pool.page_size,
                      step_tokens=engine.step_tokens, rows=c.max_batch_rows, max_events=c.max_events,
                      max_branch_tokens=c.max_branch_tokens)
    table = plan(shape, weights, box_gb, [video_dims.prefix], page_size=engine.pool.page_size, max_events=c.max_events,
                 max_branch_tokens=c.max_branch_tokens)
    return {"parts": {**asdict(peak), "total": peak.total}, "table": asdict(table)}


def measure(ckpt: Path, video: Path, threads: int, caps: tuple[int, int] = (0, 0)) -> dict:
    """In this (fresh) process: load `ckpt` through the offline command's caption stage and caption `video`
    (caps: infer.max_events / max_branch_tokens, 0 = the checkpoint's)."""
    import numpy as np
    import torch

    from infer.engine.memory_plan import VideoDims
    from infer.loading import resolve_model
    from infer.offline.job import RELEASE_INPUTS, CaptionVideos, FeaturizeForCaption
    from pipeline.config import load_config
    from pipeline.release.layout import build_layout
    from preprocess.release_media import ReleaseInputs

    torch.set_num_threads(threads)
    cfg = load_config(None, ["infer.device=cpu", "model.dtype=bfloat16", f"infer.cpu_threads={threads}",
                             "features.device=cpu", f"infer.max_events={caps[0]}", f"infer.max_branch_tokens={caps[1]}"])
    t0 = time.perf_counter()
    _, resolved = resolve_model(cfg, str(ckpt))  # the model id: the weights' hash (cached per machine after the first)
    fingerprint_s = time.perf_counter() - t0
    cfg_json = resolved.to_json(indent=None)
    size = (ckpt / BIN).stat().st_size
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    actor = CaptionVideos(cfg_json, str(ckpt))
    load_s = time.perf_counter() - t0
    model, engine = actor.engine.model, actor.engine
    _say("loaded", load_s=load_s, before=before, size=size)
    _touch_weights(model)
    load_peak = status_bytes("VmHWM")
    _say("weights read")
    vision_s, audio_s = [], []
    model.encode_video = _timed(model.encode_video, vision_s)
    model.encode_audio = _timed(model.encode_audio, audio_s)
    t0 = time.perf_counter()
    batch = {"video_id": np.array([video.stem]), "uri": np.array([str(video)]), "chunk": np.array(["c0"])}
    rows = FeaturizeForCaption(cfg_json)(batch)
    media_s = time.perf_counter() - t0
    if rows["status"][0] != "ok":
        raise RuntimeError(f"media preparation failed: {rows['error'][0]}")
    inputs = ReleaseInputs.from_bytes(rows[RELEASE_INPUTS][0])
    t_, gh, gw = inputs.grid_thw
    grid = inputs_grid(inputs)
    lay = build_layout(model.tokenizer, model.ids, grid, model.settings.instruction)
    dims = VideoDims(prefix=lay.length, timesteps=t_, patches=t_ * gh * gw,
                     audio_chunks=0 if inputs.mel is None else int(inputs.mel.shape[0]))
    _say("media prepared", media_s=media_s, dims=str(dims))
    t0 = time.perf_counter()
    row = asyncio.run(actor({c: np.array(v, dtype=object) for c, v in rows.items()}))  # the actor's call is async
    caption_s = time.perf_counter() - t0
    peak = status_bytes("VmHWM") - before
    _say("captioned", caption_s=caption_s, vision_s=vision_s, audio_s=audio_s)
    timings = row["timings"][0]
    timings = json.loads(timings) if isinstance(timings, str) else timings
    events = row["events"][0]
    events = json.loads(events) if isinstance(events, str) else events
    box_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    planned = _plan(ckpt, engine, dims, box_gb)
    decode_s = timings.get("decode_ms", 0.0) / 1000.0
    tokens = timings.get("tokens", 0.0)
    return {"checkpoint_bytes": size, "fingerprint_s": round(fingerprint_s, 2), "load_s": round(load_s, 2),
            "rss_before_load": before, "peak_rss_over_checkpoint": round((load_peak - before) / size, 3),
            "plan_predicted_bytes": planned["parts"]["total"], "measured_peak_bytes": peak,
            "plan_error": round(planned["parts"]["total"] / peak - 1.0, 3), "plan_parts": planned["parts"],
            "plan": planned["table"], "box_ram_gb": round(box_gb, 1),
            "stage_s": {"media_preparation": round(media_s, 2), "vision_tower": round(sum(vision_s), 2),
                        "audio_tower": round(sum(audio_s), 2), "prefill": round(timings.get("prefill_ms", 0) / 1000, 2),
                        "planning": round(timings.get("planning_ms", 0) / 1000, 2), "decoding": round(decode_s, 2),
                        "caption_call": round(caption_s, 2)},
            "grid_thw": list(inputs.grid_thw), "prefix_tokens": lay.length,
            "av_tokens": grid.timesteps * grid.per_step + grid.audio_tokens, "events": len(events),
            "tokens": int(tokens), "tokens_per_s": round(tokens / decode_s, 2) if decode_s else 0.0,
            "captioned": row["status"][0] == "ok", "error": row["error"][0] if row["status"][0] != "ok" else "",
            "kernel": actor.kernel, "dtype": str(model.dtype), "threads": threads,
            "caps": {"max_events": engine.cfg.max_events, "max_branch_tokens": engine.cfg.max_branch_tokens}}


def inputs_grid(inputs):
    """The AV grid of prepared media (pipeline/release/video.py `ReleaseVideo.grid`)."""
    from preprocess.release_encoders import inputs_video

    video = inputs_video(inputs, "v")
    return video.grid(int(inputs.audio_total))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=["full", "ci"], default="full")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "padcaptioner" / "full-size",
                    help="where the checkpoint is kept (about 9.4 GB at full scale)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the rendered video")
    ap.add_argument("--size", type=int, default=112, help="frame side in pixels (even)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-events", type=int, default=0, help="0 = the checkpoint's (30)")
    ap.add_argument("--max-branch-tokens", type=int, default=0, help="0 = the checkpoint's (1 + 320)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--measure", nargs=2, metavar=("CKPT", "VIDEO"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        caps = (args.max_events, args.max_branch_tokens)
        print(json.dumps(measure(Path(args.measure[0]), Path(args.measure[1]), args.threads, caps)))
        return {}
    args.cache.mkdir(parents=True, exist_ok=True)
    ckpt, built = build_checkpoint(args.cache, args.scale)
    video = render_video(args.cache / f"video-{args.seconds:g}s-{args.size}px.mp4", args.seconds, args.size)
    done = subprocess.run([sys.executable, "-m", "bench.release_full_size", "--measure", str(ckpt), str(video),
                           "--threads", str(args.threads), "--max-events", str(args.max_events),
                           "--max-branch-tokens", str(args.max_branch_tokens)], check=True, stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    result = {"scale": args.scale, **built, "video_seconds": args.seconds, "video_size": args.size,
              **json.loads(done.stdout.strip().splitlines()[-1]), "command": command("release_full_size.py", argv)}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
