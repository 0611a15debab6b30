"""Reading a release checkpoint directory: its weight files, key by key, strictly.

    files = weight_files(dir)                  # pytorch_model.bin | model.safetensors | sharded (+ index)
    state = read_state_dict(dir)               # {release key: tensor}
    towers = read_state_dict(dir, prefixes=("visual.", "audio."))   # only those keys (and their shards)
    plan = map_state_dict(state, targets, ignore=IGNORED)   # release key -> (module key) or raise

The public PadCaptioner release saves one `pytorch_model.bin` (tied `lm_head.weight`
popped) next to `config.json`; a hub re-upload may be (sharded) safetensors. All four
layouts are read here. Mapping is strict: every tensor in the file is used by exactly
one target parameter or buffer, or named in an explicit ignore list; a missing target,
an unknown key or a wrong shape is a `ReleaseError` that names the key.
Weights are memory-mapped (`torch.load(mmap=True)`, safetensors read as views of
one private map). With `prefixes` only the keys that start with one are kept: safetensors
get views of those tensors alone, and of a sharded checkpoint only the shards that hold
such a key are opened (a featurize actor's towers-only load never maps the LLM's shards).
Pure torch; no ray.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

BIN = "pytorch_model.bin"
SAFE = "model.safetensors"
INDEXES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")


class ReleaseError(ValueError):
    """A release directory cannot be loaded as it is; the message names the file or key."""


def is_release_dir(path: str | Path) -> bool:
    """A directory with a Qwen2.5-VL `config.json` that carries the release's evidence fields."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return False
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return cfg.get("model_type") == "qwen2_5_vl" and "evi_token_id" in cfg


def _wanted(key: str, prefixes: tuple[str, ...] | None) -> bool:
    return prefixes is None or key.startswith(prefixes)


def weight_files(path: str | Path, prefixes: tuple[str, ...] | None = None) -> list[Path]:
    """The weight files of a release directory, in load order (raises when there are none); of a
    sharded one with `prefixes`, only the shards its index lists for keys with those prefixes."""
    path = Path(path)
    for index in INDEXES:
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            shards = sorted({f for k, f in weight_map.items() if _wanted(k, prefixes)})
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise ReleaseError(f"{path / index} lists shards that are not there: {missing[:3]}")
            return [path / s for s in shards]
    for name in (SAFE, BIN):
        if (path / name).is_file():
            return [path / name]
    raise ReleaseError(f"{path}: no weights ({BIN}, {SAFE} or a sharded index {INDEXES})")


SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}


def mapped_safetensors(path: str | Path, prefixes: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors (those whose keys start with one of `prefixes`, when given) as
    views of one private memory map of it (pages read when touched, written pages copied: the file
    never changes). A tensor whose offset is not a multiple of its element size (the format does
    not promise it) is copied out instead."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    base = 8 + n
    out = {}
    for key, info in header.items():
        if not _wanted(key, prefixes):
            continue
        if info["dtype"] not in SAFE_DTYPES:
            raise ReleaseError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which the loader does not read")
        dtype, (begin, end) = SAFE_DTYPES[info["dtype"]], info["data_offsets"]
        chunk = raw[base + begin: base + end]
        if (base + begin) % dtype.itemsize:
            chunk = chunk.clone()
        out[key] = chunk.view(dtype).reshape(info["shape"])
    return out


def read_state_dict(path: str | Path, prefixes: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a release directory on the CPU, keyed as the release names them: all of them, or
    those whose keys start with one of `prefixes` (module doc)."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path, prefixes):
        if f.suffix == ".safetensors":
            part = mapped_safetensors(f, prefixes)
        else:  # mapped, not read: the tensors left out are dropped unread
            part = {k: v for k, v in torch.load(f, map_location="cpu", weights_only=True, mmap=True).items()
                    if _wanted(k, prefixes)}
        dup = state.keys() & part.keys()
        if dup:
            raise ReleaseError(f"{f}: tensor {sorted(dup)[0]!r} appears in more than one shard")
        state.update(part)
    return state


def map_state_dict(state: Mapping[str, torch.Tensor], rules: Iterable[tuple[str, str]],
                   targets: Mapping[str, torch.Tensor], ignore: Iterable[str] = (),
                   optional: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Release tensors -> {target key: tensor}, by prefix rules, strictly.

    rules: (release prefix, target prefix) pairs, first match wins; ignore: release keys
    read and dropped on purpose; optional: target keys that may be absent from the file
    (e.g. a tied lm_head). Raises ReleaseError naming every unknown key, missing target or
    shape mismatch (the first few of each).
    """
    rules = list(rules)
    ignore = set(ignore)
    out: dict[str, torch.Tensor] = {}
    unknown, bad_shape = [], []
    for key, tensor in state.items():
        if key in ignore:
            continue
        target = next((dst + key[len(src):] for src, dst in rules if key.startswith(src)), None)
        if target is None or target not in targets:
            unknown.append(key)
            continue
        if tuple(tensor.shape) != tuple(targets[target].shape):
            bad_shape.append(f"{key}: file {tuple(tensor.shape)} vs model {tuple(targets[target].shape)}")
            continue
        out[target] = tensor
    missing = [k for k in targets if k not in out and k not in set(optional)]
    problems = [f"{len(keys)} {what} {keys[:4]}" for what, keys in
                (("unexpected tensor(s)", unknown), ("missing tensor(s)", missing), ("shape mismatch(es)", bad_shape)) if keys]
    if problems:
        raise ReleaseError("checkpoint does not match the release model: " + "; ".join(problems))
    return out
