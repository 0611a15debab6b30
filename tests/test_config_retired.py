"""Removed and renamed config keys (pipeline/config_retired.py): an old run dir's config.json and an
old checkpoint's model meta keep loading when they hold the removed knobs' old defaults; any other
value is refused with a one-line error naming the knob; renamed keys move to their new names."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.config import Config, ConfigError, ModelConfig, from_dict, load_config
from pipeline.config_retired import REMOVED, RENAMED

# what an earlier version wrote for these keys (its defaults)
OLD_MODEL_KEYS = {"new_token_noise": 0.1, "backbone_init_std": 0.0, "anchor_feature_scale": "raw",
                  "anchor_guide_layer": 0}


def old_config_json(**model_over) -> str:
    """A run dir's config.json as an earlier version wrote it: the removed keys at their defaults and
    `grounding_max_gap` under its old name."""
    tree = Config().to_dict()
    model = tree["model"]
    model["grounding_max_gap"] = model.pop("grounding_merge_gap")
    model.update(OLD_MODEL_KEYS, **model_over)
    return json.dumps(tree)


def test_the_table_names_what_was_removed():
    assert REMOVED["ModelConfig"] == OLD_MODEL_KEYS
    assert RENAMED["ModelConfig"] == {"grounding_max_gap": "grounding_merge_gap"}
    current = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not current & set(REMOVED["ModelConfig"]) and not current & set(RENAMED["ModelConfig"])


def test_old_run_dir_config_loads_as_today_default():
    assert Config.from_json(old_config_json()) == Config()


def test_old_name_value_moves_to_the_new_name():
    assert Config.from_json(old_config_json(grounding_max_gap=3)).model.grounding_merge_gap == 3


@pytest.mark.parametrize("key,value", [("new_token_noise", 1.0), ("backbone_init_std", 0.125),
                                       ("anchor_feature_scale", "embedding"), ("anchor_guide_layer", 1)])
def test_removed_knob_at_another_value_is_a_one_line_error(key, value):
    with pytest.raises(ConfigError, match=rf"^model\.{key} was removed .*old default") as info:
        Config.from_json(old_config_json(**{key: value}))
    assert "\n" not in str(info.value)


def test_old_checkpoint_model_meta_loads():
    meta = {**dataclasses.asdict(ModelConfig()), **OLD_MODEL_KEYS}
    meta["grounding_max_gap"] = meta.pop("grounding_merge_gap")
    assert from_dict(ModelConfig, meta) == ModelConfig()


def test_both_names_at_once_is_an_error():
    tree = Config().to_dict()
    tree["model"]["grounding_max_gap"] = 2
    with pytest.raises(ConfigError, match="renamed model.grounding_merge_gap"):
        Config.from_dict(tree)


def test_overrides_keep_the_old_flag_working():
    assert load_config(None, ["model.grounding_max_gap=5"]).model.grounding_merge_gap == 5
    assert load_config(None, ["model.new_token_noise=0.1"]) == Config()  # the old default: nothing to do
    with pytest.raises(ConfigError, match="model.anchor_feature_scale was removed"):
        load_config(None, ["model.anchor_feature_scale=embedding"])
