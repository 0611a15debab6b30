"""The ablation models decode in their training layout: decoder logits == the training forward.

For the causal mask (K >= 2, both branch orders), own-<G> visibility, the chain layout
(decoded by `monolithic`) and the text chain: decode with forced lengths and traced
logits, rebuild the training sequence from the decoded tokens, run `forward_train`, and
compare every branch row. `monolithic` on the causal model is the layout the old
free-running numbers came from: its logits differ (the test that failed before the fix).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infer.engine.decoded import to_events
from infer.engine.sampling import DecodeControl
from infer.oracles.ablation import decoder_for, layout_ordered, text_chain
from infer.oracles.decoders import monolithic
from pipeline.config import InferConfig
from pipeline.examples import collate
from pipeline.layout import IGNORE, Role, dense_layout
from tests.support.padcap import decoding_model, sample

CFG = InferConfig(max_events=4, max_branch_tokens=12, device="cpu")
CONTROL = DecodeControl(num_events=3, lengths=[4, 6, 3], trace=True)


def training_rows(model, video, decoded) -> dict[tuple[int, int], torch.Tensor]:
    """(event, step) -> the training forward's logits for the decoded captions and intervals."""
    ex = model.make_example(video, with_targets=False)
    pre = ex.layout
    captions = [[t for t in toks if t != model.eos_id] for toks in decoded.tokens]
    lay = dense_layout(model.prompt[0], model.prompt[1], pre.num_segments, pre.visual_per_segment,
                       pre.audio_per_segment, captions, g_id=model.g_id, s_id=model.s_id, eos_id=model.eos_id,
                       options=model.options)
    intervals = torch.tensor(decoded.intervals, dtype=torch.float32)
    ex = dataclasses.replace(ex, layout=lay, intervals=intervals, agg_intervals=intervals)
    batch = collate([ex])
    out = model.forward_train(batch)
    pk = batch.packed
    rows = (pk.labels[0, pk.split:] != IGNORE).nonzero().flatten()
    ev, st = pk.event[0, pk.split:][rows].tolist(), pk.step[0, pk.split:][rows].tolist()
    return {(e, s): out["branch_logits"][i] for i, (e, s) in enumerate(zip(ev, st))}


def max_gap(model, video, decoded) -> float:
    train = training_rows(model, video, decoded)
    gaps = [(decoded.branch_logits[e][s] - train[(e, s)]).abs().max().item()
            for e in range(decoded.num_events) for s in range(len(decoded.tokens[e]))]
    assert len(gaps) == decoded.num_tokens
    if not model.options.padded:  # every training row is compared (factorized: + the <eos> padding rows)
        assert len(train) == decoded.num_tokens
    return max(gaps)


@pytest.mark.parametrize("order", ["blocked", "round_robin"])
def test_causal_decoder_equals_training_forward(order):
    model = decoding_model(mask="causal", branch_order=order)
    video = sample()
    got = layout_ordered(model, video, CFG, CONTROL)
    assert got.num_events == 3 and [len(t) for t in got.tokens] == [4, 6, 3]
    assert max_gap(model, video, got) < 1e-4
    if order == "blocked":  # the old free-running path: another layout, other logits
        mono = monolithic(model, video, CFG, DecodeControl(num_events=3, lengths=[4, 6, 3], trace=True))
        mono = dataclasses.replace(mono, tokens=got.tokens, branch_logits=mono.branch_logits)
        assert max_gap(model, video, mono) > 1e-2


def test_own_g_decoder_equals_training_forward():
    model = decoding_model(g_visibility="own")
    video = sample()
    got = layout_ordered(model, video, CFG, CONTROL)
    assert max_gap(model, video, got) < 1e-4
    assert decoder_for(model) is layout_ordered
    assert "factorized mask and global <G>" in model.engine_refusal("parallel")
    assert model.engine_refusal("monolithic") is None  # its single-chain path runs layout_ordered


def test_chain_layout_is_what_monolithic_decodes():
    model = decoding_model(mask="causal", layout="chain")
    video = sample()
    got = monolithic(model, video, CFG, CONTROL)
    assert max_gap(model, video, got) < 1e-4
    assert decoder_for(model) is monolithic


def test_text_chain_equals_training_forward():
    model = decoding_model(layout="sequential")
    video = sample()
    target = model.make_example(video)  # a plain sample: the events as text
    assert target.layout.kind == "plain" and target.layout.num_events == 0
    ids = target.layout.labels[target.layout.labels != IGNORE].tolist()
    got = text_chain(model, video, CFG, DecodeControl(trace=True), forced=ids)
    out = model.forward_train(collate([target]))
    assert got.token_ids == ids and ids[-1] == model.eos_id
    assert (got.logits - out["text_logits"]).abs().max().item() < 1e-4
    assert got.text.startswith("2.0-5.0 seconds: Visual: a red circle")
    assert "as text" in model.engine_refusal("parallel")
    assert (target.layout.role == Role.RESPONSE).sum() == len(ids) - 1


def test_engine_single_chain_path_uses_the_training_layout():
    from infer.engine.core import CaptionEngine
    from infer.oracles.ablation import caption_engine

    model = decoding_model(mask="causal")
    video = sample()
    cfg = dataclasses.replace(CFG, decoder="monolithic")
    with pytest.raises(ValueError, match="infer.decoder=monolithic"):
        CaptionEngine(model, CFG)
    got = caption_engine(model, cfg).caption([video])[0]
    want = layout_ordered(model, video, cfg)
    assert [(e.start, e.end, e.caption) for e in got.events] == \
        [(e.start, e.end, e.caption) for e in to_events(want, model.tokenizer, model.eos_id)]


@pytest.mark.parametrize("over,name", [({"mask": "causal"}, "layout_ordered"), ({"layout": "sequential"}, "text_chain")])
def test_heldout_free_running_decodes_ablation_models_in_their_layout(over, name):
    from pipeline.config import Config
    from train.heldout import free_running

    model = decoding_model(**over)
    cfg = Config()
    cfg.infer = CFG
    got = free_running(model, cfg, [sample(), sample(seed=1, video_id="v2")])
    assert got["decoder"] == name and got["videos"] == 2 and got["engine_errors"] == 0
    assert ("parse_problems" in got) == (name == "text_chain")  # a text baseline reports its parse failures
    if name == "text_chain":
        assert 0 <= got["parse_unparsable_videos"] <= 2 and got["parse_problems"] >= 0
