"""Config keys that were removed or renamed, so that older configs keep loading.

A run dir's config.json, a checkpoint's model meta or a preset written by an earlier version may
still hold them. `upgrade` is the one place that reads them, called for every section that
`pipeline.config.from_dict` builds:

  removed  a key that holds the value it had by default is dropped (the code now always behaves as
           that value did); any other value is an error saying that the knob was removed, since the
           current code cannot reproduce what it did;
  renamed  the old key's value moves to the new key (both at once is an error).

    >>> upgrade("ModelConfig", {"new_token_noise": 0.1, "grounding_max_gap": 3, "lora_r": 8})
    {'grounding_merge_gap': 3, 'lora_r': 8}
    >>> try:
    ...     upgrade("ModelConfig", {"backbone_init_std": 0.125}, "model.")
    ... except RetiredKeyError as e:
    ...     print(e)
    model.backbone_init_std was removed (a finished experiment); only its old default 0.0 still loads, this config has 0.125

Pure python: no torch, no ray.
"""

from __future__ import annotations

from typing import Any

REMOVED: dict[str, dict[str, Any]] = {
    "ModelConfig": {
        # the <G>/<S> rows start at the mean embedding row + noise of 0.1 embedding stds (pipeline/model.py)
        "new_token_noise": 0.1,
        # a preset backbone's random weights use HF's initializer_range (0.02)
        "backbone_init_std": 0.0,
        # the aggregated features enter the anchors as they are (no rescale to the embedding rows' RMS)
        "anchor_feature_scale": "raw",
        # the anchor guide reads the first hidden states (PadCaptioner.anchor_guide_layer)
        "anchor_guide_layer": 0,
    },
}
"""Section class name -> {removed key: the only value that still loads (its old default)}."""

RENAMED: dict[str, dict[str, str]] = {
    "ModelConfig": {"grounding_max_gap": "grounding_merge_gap"},
}
"""Section class name -> {old key: new key}."""


class RetiredKeyError(ValueError):
    """A removed key holds a value other than its old default; the message names the key."""


def upgrade(section: str, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`data` (one section's mapping, of class name `section`) without its removed keys and with its
    renamed keys under their new names; a new mapping, `data` is left as it is. `prefix` ("model.")
    only names the key in errors."""
    removed, renamed = REMOVED.get(section, {}), RENAMED.get(section, {})
    if not (removed.keys() & data.keys() or renamed.keys() & data.keys()):
        return data
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in removed:
            if not _same(value, removed[key]):
                raise RetiredKeyError(f"{prefix}{key} was removed (a finished experiment); only its old default "
                                      f"{removed[key]!r} still loads, this config has {value!r}")
        elif key in renamed:
            new = renamed[key]
            if new in data:
                raise RetiredKeyError(f"{prefix}{key} was renamed {prefix}{new}; this config sets both")
            out[new] = value
        else:
            out[key] = value
    return out


def upgrade_override(section: str, key: str, value: Any, prefix: str = "") -> str | None:
    """Where a `--set` of `key` in `section` goes: its current name (`key` itself unless renamed), or
    None for a removed key set to its old default (nothing to set); any other value of a removed
    key raises RetiredKeyError."""
    if key in REMOVED.get(section, {}):
        upgrade(section, {key: value}, prefix)
        return None
    return RENAMED.get(section, {}).get(key, key)


def is_retired(section: str, key: str) -> bool:
    """Whether `key` is a removed or renamed key of `section`."""
    return key in REMOVED.get(section, {}) or key in RENAMED.get(section, {})


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default  # ints and floats compare by value: 0 == 0.0
