"""The archive-scale bench's corpus: N short synthetic mp4s with audio and LongVALE annotations, on local
disk and on an S3 server.

    corpus = build_corpus(dir, n=10_000, distinct=200, bad=20)   # -> ArchiveCorpus
    upload(corpus, "s3://archive/corpus", workers=8)              # the same names under an S3 prefix

`distinct` videos are rendered by the synthetic generator (preprocess/synthetic.py, in parallel); the N
archive videos are hard links to them under distinct names (`a000000.mp4` ...), each with the LongVALE
record of the video it copies: rendering is the bottleneck (about a second a video here), so the output
says how many files are distinct. `bad` of the N are broken on purpose (a zero-byte file, or bytes that
are not a video, alternately): each must end as one explained error row, never fail the job.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ["data.synthetic.min_duration=8", "data.synthetic.max_duration=9", "data.synthetic.max_events=2",
             "data.synthetic.test_fraction=0.1"]


@dataclass
class ArchiveCorpus:
    """What `build_corpus` wrote: `videos` {id: local path}, `longvale` {split: annotation file}."""

    root: str
    video_dir: str
    videos: dict[str, str]
    longvale: dict[str, str]
    distinct: int
    bad: list[str] = field(default_factory=list)  # ids whose file is broken on purpose
    remote: dict[str, str] = field(default_factory=dict)  # "videos", "longvale_<split>" -> s3:// URIs

    @property
    def n(self) -> int:
        return len(self.videos)


def _bad_bytes(i: int) -> bytes:
    """Every other broken file is empty, the others hold text that no demuxer reads as a video."""
    return b"" if i % 2 == 0 else b"this is not an mp4 file\n" * 64


def build_corpus(out_dir: str | os.PathLike, n: int, distinct: int = 200, bad: int = 0, seed: int = 0,
                 workers: int = 0) -> ArchiveCorpus:
    """N videos under `<out_dir>/videos` and `longvale_{train,test}.json` (reused when already there)."""
    from preprocess.synthetic import generate_corpus

    root = Path(out_dir).resolve()
    distinct = max(1, min(distinct, n))
    cfg = load_config(ROOT / "cluster/configs/default.yaml", [
        *SYNTHETIC, f"data.synthetic.num_videos={distinct}", f"data.synthetic.seed={seed}",
        f"data.synthetic.num_workers={workers}"]).data.synthetic
    source = generate_corpus(str(root / "distinct"), cfg, progress=False)
    records = {}
    for split, path in source.longvale.items():
        for vid, rec in json.loads(Path(path).read_text()).items():
            records[vid] = (split, rec)
    sources = sorted(records)
    video_dir = root / "videos"
    video_dir.mkdir(parents=True, exist_ok=True)
    step = max(1, n // bad) if bad else 0
    broken = {i for i in range(step // 2, n, step)} if bad else set()
    broken = set(sorted(broken)[:bad])
    videos, splits, bad_ids = {}, {"train": {}, "test": {}}, []
    for i in range(n):
        vid = f"a{i:06d}"
        src = sources[i % len(sources)]
        split, rec = records[src]
        path = video_dir / f"{vid}.mp4"
        if i in broken:
            if not path.exists() or path.stat().st_nlink > 1:
                path.unlink(missing_ok=True)
                path.write_bytes(_bad_bytes(len(bad_ids)))
            bad_ids.append(vid)
        elif not path.exists():
            os.link(source.videos[src], path)
        videos[vid] = str(path)
        splits[split][vid] = rec
    longvale = {}
    for split, recs in splits.items():
        longvale[split] = str(root / f"longvale_{split}.json")
        Path(longvale[split]).write_text(json.dumps(recs))
    return ArchiveCorpus(str(root), str(video_dir), videos, longvale, distinct=len(sources), bad=bad_ids)


def upload(corpus: ArchiveCorpus, prefix: str, workers: int = 8) -> ArchiveCorpus:
    """Put every video and annotation file under the s3:// `prefix` (boto3, the AWS_* variables of this
    process); -> the corpus with `remote` filled in."""
    import boto3

    bucket, _, key0 = prefix[len("s3://"):].partition("/")
    client = boto3.client("s3")

    def put(item: tuple[str, str]) -> None:
        key, path = item
        client.upload_file(path, bucket, key)

    items = [(f"{key0}/videos/{Path(p).name}", p) for p in corpus.videos.values()]
    items += [(f"{key0}/{Path(p).name}", p) for p in corpus.longvale.values()]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(put, items))
    corpus.remote = {"videos": f"{prefix}/videos",
                     **{f"longvale_{s}": f"{prefix}/{Path(p).name}" for s, p in corpus.longvale.items()}}
    return corpus


def subset(corpus: ArchiveCorpus, out_dir: str | os.PathLike, k: int) -> ArchiveCorpus:
    """The first `k` videos of `corpus` (hard links, their annotations, its broken files among them) as a
    corpus of its own: the same flow at N/10 for the growth ratios."""
    root = Path(out_dir).resolve()
    video_dir = root / "videos"
    video_dir.mkdir(parents=True, exist_ok=True)
    keep = sorted(corpus.videos)[:k]
    videos = {}
    for vid in keep:
        path = video_dir / Path(corpus.videos[vid]).name
        if not path.exists():
            os.link(corpus.videos[vid], path)
        videos[vid] = str(path)
    longvale = {}
    for split, path in corpus.longvale.items():
        recs = {v: r for v, r in json.loads(Path(path).read_text()).items() if v in videos}
        longvale[split] = str(root / f"longvale_{split}.json")
        Path(longvale[split]).write_text(json.dumps(recs))
    return ArchiveCorpus(str(root), str(video_dir), videos, longvale, distinct=corpus.distinct,
                         bad=[v for v in corpus.bad if v in videos])
