"""Both model families meet decoding and training through pipeline/family.py's interface, and the
members that differ carry each family's rule (the engine and train/ never ask which family they hold)."""

from __future__ import annotations

import pytest
import torch

from bench.release_models import load
from pipeline.family import CheckpointFormat, DecodingFamily, TrainingFamily, well_formed
from pipeline.model import PadCaptioner
from pipeline.release.finetune import ReleaseFinetune
from tests.support.padcap import tiny_cfg


@pytest.fixture(scope="module")
def pad():
    torch.manual_seed(0)
    return PadCaptioner(tiny_cfg())


@pytest.fixture(scope="module")
def release():
    return load()


def test_both_families_implement_the_interface(pad, release):
    tuner = ReleaseFinetune(load(), lora_r=4, lora_alpha=8)
    for model in (pad, release):
        assert isinstance(model, DecodingFamily)
    for trainee in (pad, tuner):
        assert isinstance(trainee, TrainingFamily)
    assert pad.decoding_model is pad and isinstance(tuner.decoding_model, type(release))


def test_each_family_states_its_own_rules(pad, release):
    n = pad.hf_config.get_text_config(decoder=True).num_hidden_layers
    assert pad.capture_layers() == (pad.cfg.grounding_layer % (n + 1), pad.aggregation_layer)
    assert release.capture_layers()[0] == release.hf_config.get_text_config(decoder=True).num_hidden_layers - 1
    assert pad.banned_ids() == [pad.g_id, pad.s_id]
    assert release.banned_ids() == [release.g_id, release.s_id, release.shift_id]
    assert pad.default_caps() == (30, pad.cfg.max_caption_tokens + 1)
    assert release.default_caps() == (release.max_events, release.max_branch_tokens + 1)
    assert pad.engine_refusal("parallel") is None and release.engine_refusal("parallel") is None
    assert "parallel only" in release.engine_refusal("monolithic")
    assert pad.baseline_decoder is None and release.baseline_decoder is None
    assert pad.final_intervals([(-1.0, 40.0)], 30.0) == [(-1.0, 40.0)]  # the readout clipped already
    assert release.final_intervals([(-1.0, 40.0)], 30.0) == [well_formed(-1.0, 40.0, 30.0, 1e-3)] == [(0.0, 30.0)]
    assert pad.checkpoint == CheckpointFormat() and pad.counting == "tokens"
    tuner = ReleaseFinetune(load(), lora_r=4, lora_alpha=8)
    assert tuner.checkpoint == CheckpointFormat(config_file="run_config.json", merged_at_end=True)
    assert tuner.counting == "loss"


def test_step_tables_hold_the_new_rows(pad, release):
    embed, head, _ = pad.step_tables()
    ids = torch.tensor([pad.g_id, pad.s_id])
    assert torch.equal(embed[ids], pad.new_embed.detach().to(embed.dtype))
    r_embed, _, _ = release.step_tables()  # the release's rows live in its table
    assert torch.equal(r_embed, release.decoder.embed_tokens.weight)
