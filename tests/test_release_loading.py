"""Loading a release checkpoint in its own dtype: modules built on the meta device, the file's
memory-mapped tensors assigned as the weights (no random init, no fp32 detour), the file untouched."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.release_models import CHECKPOINT
from pipeline.release.checkpoint import mapped_safetensors, read_state_dict
from pipeline.release.model import ReleaseCaptioner, ReleaseSettings


def _bf16_copy(tmp_path, fmt: str):
    d = tmp_path / fmt
    shutil.copytree(CHECKPOINT, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in read_state_dict(CHECKPOINT).items()}
    if fmt == "bin":
        torch.save(state, d / "pytorch_model.bin")
    else:
        save_file(state, str(d / "model.safetensors"))
    return d, d / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_safetensors_are_read_as_views_of_a_private_map(tmp_path):
    d, f = _bf16_copy(tmp_path, "safetensors")
    mapped, copied = mapped_safetensors(f), load_file(str(f))
    assert mapped.keys() == copied.keys()
    for k, v in copied.items():
        assert mapped[k].dtype == v.dtype and torch.equal(mapped[k], v), k
    before = _digest(f)
    mapped["model.norm.weight"].add_(1.0)  # written pages are copied, the file stays as it is
    assert _digest(f) == before


def test_a_bf16_checkpoint_becomes_the_bf16_weights_without_a_copy(tmp_path, monkeypatch):
    import pipeline.release.model as release_model

    read = {}
    monkeypatch.setattr(release_model, "read_state_dict",
                        lambda path, prefixes=None: read.setdefault(str(path), read_state_dict(path, prefixes)))
    for fmt in ("bin", "safetensors"):
        d, f = _bf16_copy(tmp_path, fmt)
        model = ReleaseCaptioner.from_release(d, ReleaseSettings(dtype="bfloat16"))
        loaded = read[str(d)]
        # the mapped tensors are the parameters: same memory, no copy made
        for key, param in (("model.layers.0.mlp.up_proj.weight", model.decoder.layers[0].mlp.up_proj.weight),
                           ("audio.layers.0.fc1.weight", model.audio.whisper.layers[0].fc1.weight),
                           ("visual.blocks.0.attn.qkv.weight", model.visual.blocks[0].attn.qkv.weight)):
            assert param.data_ptr() == loaded[key].data_ptr(), (fmt, key)
        assert model.dtype == torch.bfloat16
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        # the weights are the file's own values, bit for bit (nothing random left anywhere)
        held = model.release_state_dict()
        for k, v in held.items():
            assert torch.equal(v, loaded[k]), (fmt, k)
        assert model.hf.lm_head.weight.data_ptr() == model.decoder.embed_tokens.weight.data_ptr()
        before = _digest(f)
        with torch.no_grad():
            model.decoder.layers[0].mlp.up_proj.weight.mul_(2.0)
        assert _digest(f) == before, fmt


def test_an_fp32_checkpoint_loads_in_bf16_and_on_a_named_device():
    model = ReleaseCaptioner.from_release(CHECKPOINT, ReleaseSettings(dtype="bfloat16"), device="cpu")
    state = read_state_dict(CHECKPOINT)
    w = state["model.layers.1.self_attn.q_proj.weight"]
    got = model.decoder.layers[1].self_attn.q_proj.weight
    assert got.dtype == torch.bfloat16 and got.device.type == "cpu" and torch.equal(got, w.to(torch.bfloat16))
    assert model.decoder.rotary_emb.inv_freq.device.type == "cpu"
    fp32 = ReleaseCaptioner.from_release(CHECKPOINT)
    assert fp32.dtype == torch.float32
    # RoPE's frequencies (the LLM's and the vision tower's) stay float32, as the release's bf16 load keeps them
    rope = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert len(rope) >= 2 and all(b.dtype == torch.float32 for b in rope.values()), {n: b.dtype for n, b in rope.items()}
    ref = dict(fp32.named_buffers())
    assert all(torch.equal(b, ref[n]) for n, b in rope.items())
    assert torch.equal(fp32.decoder.layers[1].self_attn.q_proj.weight, w)


def test_a_towers_only_load_reads_the_towers_and_leaves_the_llm_unread():
    from bench.release_models import fixture_video

    full = ReleaseCaptioner.from_release(CHECKPOINT)
    towers = ReleaseCaptioner.from_release(CHECKPOINT, device="cpu", towers_only=True)
    held = dict(towers.named_parameters())
    llm = [n for n in held if n.startswith("hf.model.language_model.")]
    assert llm and all(held[n].is_meta for n in llm) and all(p.is_meta for p in towers.evi_head.parameters())
    assert not any(p.is_meta for p in [*towers.visual.parameters(), *towers.audio.parameters()])
    v = fixture_video()
    grid = torch.tensor([list(v.grid_thw)])
    assert torch.equal(towers.encode_video(v.pixel_values, grid), full.encode_video(v.pixel_values, grid))
    assert torch.equal(towers.encode_audio(v.mel), full.encode_audio(v.mel))


def _sharded_copy(tmp_path):
    """The checkpoint as two safetensors shards + index: the LLM and heads in one, the towers in the other."""
    import json

    d = tmp_path / "sharded"
    shutil.copytree(CHECKPOINT, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
    state = {k: v.contiguous() for k, v in read_state_dict(CHECKPOINT).items()}
    shards = {"towers.safetensors": {k: v for k, v in state.items() if k.startswith(("visual.", "audio."))}}
    shards["llm.safetensors"] = {k: v for k, v in state.items() if k not in shards["towers.safetensors"]}
    for name, part in shards.items():
        save_file(part, str(d / name))
    weight_map = {k: name for name, part in shards.items() for k in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d, state


@pytest.mark.parametrize("fmt", ["bin", "safetensors", "sharded"])
def test_a_towers_only_load_takes_only_the_tower_tensors_from_the_file(tmp_path, fmt, monkeypatch):
    handed: dict[str, torch.Tensor] = {}
    real = ReleaseCaptioner.load_release_state

    def spy(self, state, **kw):
        handed.update(state)
        return real(self, state, **kw)

    monkeypatch.setattr(ReleaseCaptioner, "load_release_state", spy)
    if fmt == "sharded":
        d, state = _sharded_copy(tmp_path)
        (d / "llm.safetensors").write_bytes(b"not read")  # the LLM's shard is never opened
    elif fmt == "safetensors":
        d = tmp_path / fmt
        shutil.copytree(CHECKPOINT, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
        state = {k: v.contiguous() for k, v in read_state_dict(CHECKPOINT).items()}
        save_file(state, str(d / "model.safetensors"))
    else:
        d, state = CHECKPOINT, read_state_dict(CHECKPOINT)
    towers = ReleaseCaptioner.from_release(d, device="cpu", towers_only=True)
    tower_keys = {k for k in state if k.startswith(("visual.", "audio."))}
    assert tower_keys and set(handed) == tower_keys  # no LLM or head tensor in the loaded state
    held = sum(v.nbytes for v in handed.values())
    assert held < 0.8 * sum(v.nbytes for v in state.values())  # the LLM is most of the file's bytes
    assert all(p.is_meta for p in towers.decoder.parameters())
    assert torch.equal(towers.visual.blocks[0].attn.qkv.weight, state["visual.blocks.0.attn.qkv.weight"])
    if fmt == "sharded":
        with pytest.raises(Exception):  # the whole model does need that shard
            ReleaseCaptioner.from_release(d)
