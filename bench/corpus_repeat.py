"""Does the synthetic corpus come out with the same bytes every time? Render the default's 144 videos
repeatedly, as the generator does (a pool of spawned workers), and count the videos whose bytes vary.

    .venv/bin/python -m bench.corpus_repeat --runs 5 --busy 2                    # the generator's libx264 settings
    .venv/bin/python -m bench.corpus_repeat --runs 5 --busy 2 --x264 asm=auto    # libx264 with its CPU's SIMD code

Every video's rendered frames, audio and yuv420p planes are hashed in the worker beside its mp4, so a
differing mp4 is told apart from differing encoder input. `--busy K` runs K busy-loop processes
beside the pool (the odd encodes were more frequent on a loaded box). `--x264` replaces the
generator's `x264-params` (`preprocess.synthetic_media.X264_PARAMS`) in the workers.

Written: `<out>/corpus_repeat<_x264>.json` with per run the seconds and the mp4 hashes' odd videos
(those whose bytes differ from the run-majority), and the counts of videos whose frames, audio,
yuv planes or mp4 differ across the runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _init(x264: str | None) -> None:
    if x264 is not None:
        from preprocess import synthetic_media

        synthetic_media.X264_PARAMS = x264


def _render(script, out_dir: str) -> tuple[str, dict[str, str]]:
    """One video as `preprocess.synthetic.render_video` makes it -> (id, {part: sha256[:16]})."""
    import numpy as np

    from preprocess.synthetic_media import render_audio, render_frames, rgb_to_yuv420p, write_mp4

    rng = np.random.default_rng(list(script.entropy))
    frames, audio = render_frames(script, rng), render_audio(script, rng)
    path = Path(out_dir) / f"{script.video_id}.mp4"
    write_mp4(path, frames, audio, script.fps, script.sample_rate)
    yuv = np.stack([rgb_to_yuv420p(f) for f in frames])
    parts = {"frames": frames.tobytes(), "audio": audio.tobytes(), "yuv": yuv.tobytes(), "mp4": path.read_bytes()}
    path.unlink()
    return script.video_id, {k: hashlib.sha256(v).hexdigest()[:16] for k, v in parts.items()}


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def varying(runs: list[dict[str, dict[str, str]]], part: str) -> dict[str, int]:
    """{video: number of distinct hashes of `part`} for the videos with more than one.

    >>> varying([{"a": {"mp4": "1"}, "b": {"mp4": "2"}}, {"a": {"mp4": "1"}, "b": {"mp4": "3"}}], "mp4")
    {'b': 2}
    """
    out = {}
    for vid in runs[0]:
        n = len({r[vid][part] for r in runs})
        if n > 1:
            out[vid] = n
    return out


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import load_config
    from preprocess.synthetic import script_corpus

    ap = argparse.ArgumentParser(prog="python -m bench.corpus_repeat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2, help="the generator's pool size")
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the pool")
    ap.add_argument("--x264", default=None, help="x264-params for the workers (default: the generator's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    scripts = script_corpus(load_config(ROOT / "cluster/configs/default.yaml").data.synthetic)
    ctx = mp.get_context("spawn")
    runs, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            busy = [ctx.Process(target=_busy, args=(3600.0,), daemon=True) for _ in range(args.busy)]
            for p in busy:
                p.start()
            t0 = time.perf_counter()
            try:
                with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_init, initargs=(args.x264,)) as pool:
                    runs.append(dict(pool.map(_render, scripts, [tmp] * len(scripts))))
            finally:
                for p in busy:
                    p.kill()
            seconds.append(round(time.perf_counter() - t0, 1))
            print(f"run {i + 1}/{args.runs}: {seconds[-1]} s", flush=True)
    majority = {vid: Counter(r[vid]["mp4"] for r in runs).most_common(1)[0][0] for vid in runs[0]}
    from preprocess.synthetic_media import X264_PARAMS

    result = {
        "command": "python -m bench.corpus_repeat " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "videos": len(scripts), "workers": args.workers, "busy": args.busy,
        "x264_params": args.x264 if args.x264 is not None else X264_PARAMS,
        "runs": [{"seconds": s, "odd_mp4": sorted(v for v in r if r[v]["mp4"] != majority[v])} for s, r in zip(seconds, runs)],
        "varying": {part: varying(runs, part) for part in ("frames", "audio", "yuv", "mp4")},
    }
    result["odd_encodes"] = sum(len(r["odd_mp4"]) for r in result["runs"])
    tag = "" if args.x264 is None else "_" + args.x264.replace("=", "_")
    out = Path(args.out) / f"corpus_repeat{tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("x264_params", "odd_encodes", "varying")}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
