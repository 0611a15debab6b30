"""The ablation's data: one synthetic corpus, featurized once, as two WebDataset shards.

    shards = prepare_shards(cfg, work_dir)   # {"train": ".../train.tar", "test": ".../test.tar"}

Every variant of bench/ablation.py trains on `train.tar` and is evaluated on
`test.tar`, so all of them see the same videos in the same records. The corpus is
rendered by preprocess.synthetic and featurized by preprocess.featurize (the code the
preprocess stage runs per video), in this process: no Ray, so the driver holds no Ray
cluster. A shard set is reused when its stamp (the synthetic + features config) matches.
A video that fails to featurize is an error, not a smaller corpus.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from pathlib import Path

from pipeline.config import Config
from pipeline.schema import KEY, encode

STAMP = "shards.json"


def _stamp(cfg: Config) -> dict:
    return {"synthetic": dataclasses.asdict(cfg.data.synthetic), "features": dataclasses.asdict(cfg.features), "version": 1}


def write_tar(path: Path, samples) -> None:
    """Samples -> one WebDataset tar (`<key>.<field>` members, a sample's fields together)."""
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for s in samples:
            fields = encode(s)
            for name, data in fields.items():
                if name == KEY:
                    continue
                info = tarfile.TarInfo(f"{fields[KEY]}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)


def prepare_shards(cfg: Config, work_dir: str | Path, progress: bool = False) -> dict[str, str]:
    """Render + featurize the corpus of `cfg.data.synthetic` into work_dir/shards (or reuse it)."""
    from preprocess.annotations import read_annotations
    from preprocess.featurize import Featurizer
    from preprocess.synthetic import generate_corpus

    out = Path(work_dir) / "shards"
    paths = {split: str(out / f"{split}.tar") for split in ("train", "test")}
    stamp = out / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == _stamp(cfg) and all(Path(p).exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    info = generate_corpus(Path(work_dir) / "synth", cfg.data.synthetic, progress=progress)
    featurizer = Featurizer(cfg)
    for split, ann_path in sorted(info.annotations("longvale").items()):
        anns, bad = read_annotations(ann_path, "longvale", split)
        if bad:
            raise RuntimeError(f"synthetic {split} annotations have errors: {bad[:2]}")
        samples = [featurizer(info.videos[a.video_id], a) for a in anns]
        write_tar(Path(paths[split]), samples)
    stamp.write_text(json.dumps(_stamp(cfg), sort_keys=True))
    return paths
