"""Config: presets load, overrides apply, bad keys/types are named, JSON round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, apply_overrides, load_config, section_hash

PRESETS = sorted((Path(__file__).resolve().parents[1] / "cluster" / "configs").glob("*.yaml"))


def test_presets_exist():
    names = {p.name for p in PRESETS}
    assert {"default.yaml", "gpu-1.yaml", "multi-node.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_round_trips(path):
    cfg = load_config(path)
    assert Config.from_json(cfg.to_json()) == cfg


def test_default_preset_matches_builtin_defaults_where_it_speaks():
    cfg = load_config(PRESETS[[p.name for p in PRESETS].index("default.yaml")])
    assert cfg.model.backbone == "tiny" and cfg.train.use_gpu is False


def test_overrides_parse_yaml_scalars_and_lists():
    cfg = apply_overrides(Config(), ["train.max_steps=7", "model.mask=causal", "train.lr=1e-4",
                                     "model.lora_targets=[q_proj, v_proj]", "model.av_bidirectional=false",
                                     "data.annotations={train: a.json}"])
    assert cfg.train.max_steps == 7
    assert cfg.model.mask == "causal"
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.model.lora_targets == ["q_proj", "v_proj"]
    assert cfg.model.av_bidirectional is False
    assert cfg.data.annotations == {"train": "a.json"}


def test_int_widens_to_float():
    cfg = apply_overrides(Config(), ["train.lr=1"])
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.max_stepz=3", "train.max_stepz"),
        ("nosuch.key=3", "nosuch"),
        ("train.max_steps.deeper=3", "train.max_steps"),
        ("train.max_steps=abc", "train.max_steps"),
        ("train.max_steps=1.5", "train.max_steps"),
        ("model.mask=diagonal", "model.mask"),
        ("model.av_bidirectional=3", "model.av_bidirectional"),
        ("model.lora_targets=q_proj", "model.lora_targets"),
        ("model.lora_targets=[1, 2]", "model.lora_targets[0]"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), [override])
    assert needle in str(err.value)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(Config(), ["train.max_steps"])


def test_unknown_yaml_key_is_an_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 3\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(p)


def test_wrong_section_type_is_an_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train"):
        load_config(p)


def test_json_round_trip_is_lossless_after_overrides():
    cfg = apply_overrides(Config(), ["serve.allowed_roots=[/a, s3://b/c]", "train.lr=0.5", "run_dir=s3://x/y"])
    again = Config.from_json(cfg.to_json())
    assert again == cfg and again.to_json() == cfg.to_json()


def test_section_hash_is_stable_and_sensitive():
    a, b = Config(), Config()
    assert section_hash(a.features) == section_hash(b.features)
    c = apply_overrides(Config(), ["features.frames_per_segment=4"])
    assert section_hash(c.features) != section_hash(a.features)
    assert section_hash(c.model) == section_hash(a.model)


def test_override_adds_a_key_of_a_mapping_field():
    """data.annotations is split -> file: `--set data.annotations.test=...` sets one split."""
    cfg = apply_overrides(Config(), ["data.annotations={train: a.json}", "data.annotations.test=/d/test.json"])
    assert cfg.data.annotations == {"train": "a.json", "test": "/d/test.json"}
    with pytest.raises(ConfigError, match="data.annotations.test.x"):
        apply_overrides(Config(), ["data.annotations.test.x=1"])


@pytest.mark.parametrize("raw", ["Describe every event #1 first.", "Note: name the sound.", "2023", "yes"])
def test_string_override_is_taken_verbatim(raw):
    """A string value is the text after `=`, not YAML: no comment cut at ` #`, no mapping
    made of `a: b`, no int or bool made of `2023` / `yes`."""
    cfg = apply_overrides(Config(), [f"model.instruction={raw}", f"train.val_split={raw}"])
    assert cfg.model.instruction == raw and cfg.train.val_split == raw


def test_quoted_string_override_is_unquoted():
    cfg = apply_overrides(Config(), ["model.instruction='a # b'", 'train.val_split="val"', "model.mask='causal'"])
    assert cfg.model.instruction == "a # b" and cfg.train.val_split == "val" and cfg.model.mask == "causal"


@pytest.mark.parametrize("override", ["train.lr=nan", "train.lr=.nan", "train.grad_clip=NaN"])
def test_nan_number_is_an_error(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        apply_overrides(Config(), [override])


def test_nan_in_yaml_is_an_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(p)
