"""Preprocess throughput, side by side in one run: decode only, decode + encode, the Ray Data job.

    python -m bench.preprocess [--videos 32] [--seconds 60] [--actors 2] [--out bench.json]

(a) decode-only loop over the corpus (the floor), (b) decode + encode in one plain
Python process, (c) the Ray Data job (actor pool, shards + manifest written).
Prints JSON: videos/s and segments/s of each, the ratios c/b and b/a, and where
the time of (b) goes (decode vs encode).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--corpus", default="", help="reuse/generate the corpus here (default: a temp dir)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from pipeline.config import load_config
    from preprocess.featurize import Featurizer
    from preprocess.media import decode_video
    from preprocess.synthetic import generate_corpus

    cfg = load_config(ROOT / "cluster/configs/default.yaml", [
        f"data.synthetic.num_videos={args.videos}", f"data.synthetic.min_duration={args.seconds}",
        f"data.synthetic.max_duration={args.seconds}", "data.synthetic.test_fraction=0.0",
        f"cluster.preprocess_actors={args.actors}"])
    tmp = tempfile.mkdtemp(prefix="bench-preprocess-")
    corpus_dir = args.corpus or os.path.join(tmp, "synth")
    info = generate_corpus(corpus_dir, cfg.data.synthetic)
    videos = sorted(info.videos.items())
    anns = {}
    from preprocess.annotations import read_annotations

    for split, path in info.longvale.items():
        for a in read_annotations(path, "longvale", split)[0]:
            anns[a.video_id] = a

    # (a) decode only
    t0 = time.perf_counter()
    segments = 0
    for _, path in videos:
        segments += decode_video(path, cfg.features).segment_times.shape[0]
    t_decode = time.perf_counter() - t0

    # (b) decode + encode, one process
    featurizer = Featurizer(cfg)
    t0 = time.perf_counter()
    for vid, path in videos:
        featurizer(path, anns[vid])
    t_plain = time.perf_counter() - t0

    # (c) the Ray Data job
    import ray

    from preprocess.job import run_preprocess

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        t0 = time.perf_counter()
        summary = run_preprocess(cfg, {s: (p, "longvale") for s, p in info.longvale.items()}, info.video_dir,
                                 os.path.join(tmp, "out"), chunk_videos=max(64, args.videos))
        t_ray = time.perf_counter() - t0
    finally:
        ray.shutdown()
    n = len(videos)
    result = {
        "videos": n, "seconds_per_video": args.seconds, "segments": segments, "cpus": os.cpu_count(),
        "ray_actors": args.actors, "ray_ok": summary["ok"], "ray_failed": summary["failed"],
        "decode_only": {"seconds": t_decode, "videos_per_s": n / t_decode, "segments_per_s": segments / t_decode},
        "decode_encode_plain": {"seconds": t_plain, "videos_per_s": n / t_plain, "segments_per_s": segments / t_plain},
        "ray_job": {"seconds": t_ray, "videos_per_s": n / t_ray, "segments_per_s": segments / t_ray},
        "ratio_ray_over_plain": t_plain / t_ray,  # c/b throughput ratio (target >= 0.8)
        "ratio_plain_over_decode": t_decode / t_plain,  # b/a throughput ratio
        "time_split_plain": {"decode": t_decode / t_plain, "encode": max(0.0, t_plain - t_decode) / t_plain},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
