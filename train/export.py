"""The model directory of a training checkpoint: `python -m train.export CHECKPOINT OUT`.

    out = export_model("runs/x/train/ray/<run>/checkpoint_0000400", "runs/x/model-400")

A checkpoint with a `model/` directory (PadCaptioner runs) is copied. One without (the release
fine-tune: its checkpoints hold only the trained tensors, train/checkpoint.py) is made into
a release-format directory: the run's config (the checkpoint's config.json) rebuilds the
fine-tuning model on its base checkpoint (`model.backbone`), the trained tensors (LoRA,
grounding heads, <G>/<S> rows) are loaded into it exactly, and `save_pretrained` writes the
merged model with the run's config beside it, as the end of a run does. Pure torch; no ray.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pipeline.config import Config
from train import checkpoint as ckpt


def export_model(checkpoint: str | Path, out: str | Path) -> Path:
    """See the module docstring. -> the written directory."""
    checkpoint, out = Path(checkpoint), Path(out)
    if (checkpoint / ckpt.MODEL_DIR).is_dir():
        shutil.copytree(checkpoint / ckpt.MODEL_DIR, out, dirs_exist_ok=True)
        return out
    from pipeline.release.finetune import release_tuner

    config_json = (checkpoint / ckpt.CONFIG_FILE).read_text()
    tuner = release_tuner(Config.from_json(config_json))
    ckpt.load_checkpoint(checkpoint, model=tuner)  # the trained tensors, exactly
    tuner.save_pretrained(out)
    (out / tuner.checkpoint.config_file).write_text(config_json)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a training checkpoint directory (train_state.pt, config.json)")
    ap.add_argument("out", type=Path, help="where the model directory is written")
    args = ap.parse_args(argv)
    print(export_model(args.checkpoint, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
