"""Loading a release checkpoint: peak host memory over the checkpoint's size, and the time.

    .venv/bin/python -m bench.release_load --out bench/results/release_load.json

Builds a release-format model of a few hundred million parameters (the fixture's config with
wider, deeper parts: `--hidden`, `--layers`), saves it as the release does (bf16 state dict,
tied head popped; `pytorch_model.bin`, and `model.safetensors` as a hub re-upload would be),
then loads each with `ReleaseCaptioner.from_release` in bf16 in a fresh process, reads every
weight once (the file is mapped lazily: that is when its pages come in), and records
`peak_rss_over_checkpoint` = (peak RSS (VmHWM) - RSS before the load) / the file's bytes (the
issue's target: at most 1.3), the same before the weights were read, and the times. RSS counts
the mapped file pages, so a load whose weights are the mapped tensors reads about 1.0.
Pure torch + HF.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.output import command, emit

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = ROOT / "tests" / "data" / "release_golden" / "checkpoint"


def status_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak of this process image; ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def make_checkpoint(out: Path, hidden: int, layers: int) -> dict:
    """A release directory with the fixture's tokenizer and a wider config; returns its sizes."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.release.model import ReleaseCaptioner

    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
               num_attention_heads=hidden // 64, num_key_value_heads=2, vision_audio_layer_index=layers // 2)
    v = cfg["vision_config"]
    v.update(hidden_size=hidden // 2, intermediate_size=hidden * 3 // 4, num_heads=hidden // 128, depth=4,
             out_hidden_size=hidden, fullatt_block_indexes=[3])
    a = cfg["audio_config"]
    a.update(d_model=hidden // 2, encoder_ffn_dim=hidden * 2, encoder_layers=4, num_hidden_layers=4,
             encoder_attention_heads=hidden // 128)
    q = a["qformer_config"]
    q.update(hidden_size=hidden // 2, intermediate_size=hidden, encoder_width=hidden // 2, num_attention_heads=4,
             out_hidden_size=hidden)
    out.mkdir(parents=True, exist_ok=True)
    for f in FIXTURE.iterdir():
        if f.name != "pytorch_model.bin":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model = ReleaseCaptioner(AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out))
    state = {k: t.to(torch.bfloat16).contiguous() for k, t in model.release_state_dict().items()}
    params = sum(t.numel() for t in state.values())
    torch.save(state, out / "pytorch_model.bin")
    return {"parameters": params, "bytes": (out / "pytorch_model.bin").stat().st_size}


def measure(path: str, fmt: str) -> dict:
    """In this (fresh) process: load `path` (its `fmt` weights only) in bf16 -> the figures."""
    import torch

    from pipeline.release.model import ReleaseCaptioner, ReleaseSettings

    torch.set_num_threads(1)
    weights = Path(path) / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    model = ReleaseCaptioner.from_release(path, ReleaseSettings(dtype="bfloat16"))
    seconds = time.perf_counter() - t0
    peak_load = status_bytes("VmHWM")
    # the weights are mapped lazily: touch every one (what the first forward does) before the peak that counts
    with torch.no_grad():
        total = sum(float(c.sum(dtype=torch.float32)) for t in model.state_dict().values() if t.is_floating_point()
                    for c in t.reshape(-1).split(1 << 20))  # in chunks: the reduction's own temporaries stay small
    resident = time.perf_counter() - t0
    peak = status_bytes("VmHWM")
    size = weights.stat().st_size
    return {"format": fmt, "checkpoint_bytes": size, "rss_before": before, "peak_rss": peak,
            "peak_rss_over_checkpoint": round((peak - before) / size, 3),
            "peak_rss_over_checkpoint_before_touching": round((peak_load - before) / size, 3),
            "load_seconds": round(seconds, 2), "load_and_touch_seconds": round(resident, 2),
            "dtype": str(model.dtype), "checksum": total}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--measure", nargs=2, metavar=("DIR", "FORMAT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return {}
    with tempfile.TemporaryDirectory(prefix="release-load-") as tmp:
        ckpt = Path(tmp) / "checkpoint"
        sizes = make_checkpoint(ckpt, args.hidden, args.layers)
        runs = []
        for fmt in ("bin", "safetensors"):
            d = Path(tmp) / fmt
            shutil.copytree(ckpt, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
            if fmt == "bin":
                shutil.copy2(ckpt / "pytorch_model.bin", d / "pytorch_model.bin")
            else:
                import torch
                from safetensors.torch import save_file

                save_file(torch.load(ckpt / "pytorch_model.bin", weights_only=True), str(d / "model.safetensors"))
            done = subprocess.run([sys.executable, "-m", "bench.release_load", "--measure", str(d), fmt],
                                  check=True, capture_output=True, text=True, cwd=str(ROOT))
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = {"hidden": args.hidden, "layers": args.layers, **sizes, "runs": runs,
              "command": command("release_load.py", argv)}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
