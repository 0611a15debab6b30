"""Typed building of the config dataclasses from mappings (YAML, JSON, overrides).

`from_dict(cls, data)` checks every value against the field's annotation (Literal, list, dict,
nested sections; ints widen to floats; NaN is refused) and raises `ConfigError` naming
the key. Keys removed or renamed since an earlier version are dealt with first
(pipeline/config_retired.py), so older run dirs and checkpoints keep loading.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Section:
    ...     lr: float = 1e-3
    ...     steps: int = 10
    >>> from_dict(Section, {"lr": 1, "steps": 3})
    Section(lr=1.0, steps=3)
    >>> try:
    ...     from_dict(Section, {"steps": "3"}, prefix="train.")
    ... except ConfigError as e:
    ...     print(e)
    train.steps: expected an integer, got str '3'

Pure python: no torch, no ray.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

from pipeline.config_retired import RetiredKeyError, upgrade


class ConfigError(ValueError):
    """A config key is unknown, missing or of the wrong type; the message names it."""


def type_name(tp: Any) -> str:
    """An annotation as errors and the config reference (pipeline/reference_docs.py) spell it: `int`, `list[str]`."""
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


_EXPECTED = {bool: "true/false", int: "an integer", str: "a string"}  # what an error says a scalar field wants


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return {_coerce(k, args[0], f"{key} key"): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp in _EXPECTED:  # bool, int (a bool is not one), str: taken as they are
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {_EXPECTED[tp]}, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if math.isnan(value):  # compares false with everything: would pass every check downstream
            raise ConfigError(f"{key}: expected a number, got nan")
        return float(value)
    raise ConfigError(f"{key}: unsupported annotation {type_name(tp)}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a (partial) mapping; unknown keys and bad types raise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        data = upgrade(cls.__name__, data, prefix)  # keys removed or renamed since (pipeline/config_retired.py)
    except RetiredKeyError as e:
        raise ConfigError(str(e)) from None
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (valid keys in {prefix or 'the root'}: {sorted(names)})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)
