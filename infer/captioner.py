"""The Python API: caption a handful of videos in this process, without Ray.

    from infer import Captioner

    captioner = Captioner.from_pretrained("runs/default/train/model")      # or the release checkpoint dir
    for result in captioner.caption(["a.mp4", "s3://bucket/b.mp4"]):
        print(result.video_id, result.status, [(e["start"], e["end"], e["caption"]) for e in result.events])

Each result is an `infer.results.CaptionResult`: the same fields as a row of the offline job's output
(`padcap caption`), `.to_dict()` for JSON. A video that cannot be read or captioned is a result with
status "error" and the reason, never an exception that loses the others. For an archive, use
`padcap caption` (Ray Data: many processes and nodes, resumable); this is one process, one model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from infer.loading import load_model
from infer.oracles.ablation import caption_engine
from infer.results import CaptionResult, caption_config_hash, caption_each, video_ids
from pipeline.config import Config, load_config
from preprocess.featurize import Featurizer, Unannotated


class Captioner:
    """A loaded model, its feature encoders and a decoding engine."""

    def __init__(self, cfg: Config, model, model_id: str):
        self.cfg = cfg
        self.model = model
        self.model_id = model_id
        self.config_hash = caption_config_hash(cfg)
        self.engine = caption_engine(model, cfg.infer)  # the engine, or the single chain infer.decoder=monolithic asks for
        self.featurizer = Featurizer(cfg)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: str | Path | None = None, device: str | None = None,
                        overrides: Sequence[str] = ()) -> Captioner:
        """Load `model_dir` (a trained model dir or a release checkpoint dir; `infer.loading.RANDOM_MODEL` for
        a random tiny model) with the preset `config` (default: the embedded default), `overrides`
        ("key=value", as `--set`) and `device` ("cpu", "cuda"; default: infer.device, CUDA when there is one)."""
        extra = [f"infer.device={device}", f"features.device={device}"] if device else []
        cfg = load_config(str(config) if config else None, [*overrides, *extra])
        model, card, cfg = load_model(cfg, str(model_dir))
        return cls(cfg, model, card.model_id)

    def caption(self, videos: str | Path | Sequence[str | Path]) -> list[CaptionResult]:
        """One result per video (local paths or URIs, e.g. s3://), in the order given."""
        if isinstance(videos, (str, Path)):
            videos = [videos]
        fields = {"model_id": self.model_id, "config_hash": self.config_hash}
        items = []
        uris = [str(v) for v in videos]
        for video, video_id in zip(uris, video_ids(uris)):
            try:
                items.append((video_id, video, self.featurizer(video, Unannotated(video_id=video_id, source="api"))))
            except Exception as e:  # a video that cannot be read is its own result, not the batch's end
                items.append(CaptionResult.failed(video_id, video, "input", f"{type(e).__name__}: {e}", **fields))
        return caption_each(self.engine, items, **fields)
