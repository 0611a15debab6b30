"""The HF causal-LM backbone of PadCaptioner: presets, loading, and the position adapter.

    model, ref = load_backbone(cfg.model, vocab_size=len(tokenizer))
    adapter = position_adapter(model.config)     # layout positions -> backbone position ids

Backbones are the Qwen2 family (Qwen2 / Qwen2.5 LMs), either
  * a preset with random weights, built from the real config numbers and seeded by
    `model.backbone_seed` (tests, benchmarks, the embedded synthetic default):
    `tiny` (hidden 64, 4 layers, 4 heads, 2 KV heads), `qwen2.5-0.5b`, `qwen2.5-3b`;
  * or a local HF directory (`model.backbone` = path), loaded with local files only.
`ref` ({"kind": "preset", "name", "seed"} or {"kind": "path", "path"}) is what a
checkpoint records to rebuild the same base weights.

Position adapter: the seam between the layout's 1D positions (pipeline/layout.py) and
the backbone's RoPE. `Rope1D` (Qwen2) passes them through and rotates single q/k rows
for the aggregation attention row; `MRope` (Qwen2.5-VL's LLM, the release model) rotates
rows at [N, 3] (t, h, w) ids, a text row having one id on all three axes.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen2Config

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, vocab_size=None),
    # real Qwen2.5 numbers (config.json of Qwen/Qwen2.5-0.5B and -3B)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1000000.0, vocab_size=151936),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, rope_theta=1000000.0, vocab_size=151936),
}
SUPPORTED_MODEL_TYPES = ("qwen2",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BackboneError(ValueError):
    """The backbone cannot be built or is not supported; the message says why."""


def preset_config(name: str, vocab_size: int) -> Qwen2Config:
    """A Qwen2Config for a preset; the vocabulary grows to hold `vocab_size` ids; its random weights
    have HF's initializer_range (0.02)."""
    if name not in PRESETS:
        raise BackboneError(f"unknown backbone preset {name!r} (presets: {sorted(PRESETS)}; or give a local path)")
    p = dict(PRESETS[name])
    theta = p.pop("rope_theta")
    vocab = max(p.pop("vocab_size") or 0, vocab_size)
    return Qwen2Config(
        **p, vocab_size=vocab, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, use_sliding_window=False,
        hidden_act="silu", attention_dropout=0.0,
    )


# the rotary embeddings' frequency buffers (HF's text and vision rotary modules, the dynamic-RoPE copy)
ROPE_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_keeping_rope(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """module.to(dtype), except the rotary frequency buffers (ROPE_BUFFERS), which stay float32.

    HF computes `inv_freq` in float32 whatever the model's dtype and takes the angles in float32, and
    `from_pretrained(dtype=torch.bfloat16)` (how the release runs its model) keeps it so; DeepSpeed's bf16
    casts parameters only, for the same reason. A blanket `.to(torch.bfloat16)` rounds each frequency to 8
    bits, and the angle at position p moves by up to p x 2^-9 of it: cos/sin off by up to 0.9 at position
    1,000 (head dim 128, theta 1e6), so a bf16 decode of a long prompt would not be the model that was
    trained. Returns the module."""
    kept = [(m, name, buf.detach().clone()) for m in module.modules() for name, buf in m._buffers.items()
            if name in ROPE_BUFFERS and buf is not None and buf.is_floating_point()]
    module.to(dtype)
    for m, name, buf in kept:
        m._buffers[name] = buf.to(device=m._buffers[name].device, dtype=torch.float32)
    return module


def scale_attention_init(model: PreTrainedModel, std: float, init_std: float) -> None:
    """A random-init preset's query and key projections rescaled from `init_std` to `std` (0: left as
    they are). The same random directions, so the rest of the seeded init is unchanged; attention
    logits grow by (std / init_std)^2, the values and the residual stream not at all."""
    if std <= 0 or std == init_std:
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(std / init_std)


def load_backbone(model_cfg, vocab_size: int) -> tuple[PreTrainedModel, dict]:
    """Build (preset, seeded random init) or load (local path) the causal LM; see module doc."""
    dtype = DTYPES[model_cfg.dtype]
    name = model_cfg.backbone
    if name in PRESETS:
        config = preset_config(name, vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model_cfg.backbone_seed)
            # from_config(attn_implementation=...) mutates the config it is given: pass a copy
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype,
                                                     attn_implementation=model_cfg.attn_implementation)
        scale_attention_init(model, model_cfg.attention_init_std, config.initializer_range)
        ref = {"kind": "preset", "name": name, "seed": model_cfg.backbone_seed}
    else:
        path = Path(name)
        if not (path / "config.json").exists():
            raise BackboneError(f"backbone {name!r} is neither a preset ({sorted(PRESETS)}) nor a local HF model directory")
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        if hf_cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise BackboneError(f"backbone model_type {hf_cfg.model_type!r} is not supported yet "
                                f"(supported: {SUPPORTED_MODEL_TYPES}); it needs its own position adapter")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     attn_implementation=model_cfg.attn_implementation)
        if model.get_input_embeddings().weight.shape[0] < vocab_size:
            model.resize_token_embeddings(vocab_size, mean_resizing=False)
        ref = {"kind": "path", "path": str(path.resolve())}
    return model, ref


# --------------------------------------------------------------------------- position adapters


class PositionAdapter(Protocol):
    kind: str

    def position_ids(self, position: torch.Tensor, segment: torch.Tensor, role: torch.Tensor) -> torch.Tensor:
        """Layout positions [B, L] (+ segment / role [B, L]) -> the backbone's position ids."""

    def rotate(self, decoder, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Apply the backbone's RoPE to x [..., N, head_dim] at position ids [N]."""


class Rope1D:
    """Qwen2 / Qwen2.5 LMs: 1D RoPE; position ids are the layout positions as they are."""

    kind = "rope1d"

    def position_ids(self, position: torch.Tensor, segment: torch.Tensor, role: torch.Tensor) -> torch.Tensor:
        return position

    def rotate(self, decoder, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        rotate_half = importlib.import_module(type(decoder).__module__).rotate_half
        cos, sin = decoder.rotary_emb(x, position_ids[None])  # [1, N, head_dim]
        cos, sin = cos[0].to(x.dtype), sin[0].to(x.dtype)
        return x * cos + rotate_half(x) * sin


class MRope:
    """Qwen2.5-VL's LLM (the release model): M-RoPE, position ids [N, 3] (t, h, w) per row; a text row
    has the same id on all three axes (then M-RoPE is 1D RoPE)."""

    kind = "mrope"

    def position_ids(self, position: torch.Tensor, segment: torch.Tensor, role: torch.Tensor) -> torch.Tensor:
        """Text positions [B, L] -> [3, B, L] (the same id on every axis); the release's prompt ids come
        from pipeline/release/layout.py `mrope_ids`."""
        return position[None].expand(3, *position.shape)

    def rotate(self, decoder, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [..., N, head_dim] rotated at ids [N, 3] (or [N] for text: the same id on all axes)."""
        rotate_half = importlib.import_module(type(decoder).__module__).rotate_half
        ids = position_ids if position_ids.ndim == 2 else position_ids[:, None].expand(-1, 3)
        cos, sin = decoder.rotary_emb(x, ids.T[:, None, :])  # [1, N, head_dim]
        cos, sin = cos[0].to(x.dtype), sin[0].to(x.dtype)
        return x * cos + rotate_half(x) * sin


ADAPTERS = {"qwen2": Rope1D, "qwen2_5_vl": MRope}  # model_type -> its position adapter


def position_adapter(hf_config) -> PositionAdapter:
    """The adapter for a backbone config: 1D RoPE (qwen2) or the release LLM's M-RoPE (qwen2_5_vl);
    other types raise (no silent fallback)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]()
    raise BackboneError(f"no position adapter for model_type {model_type!r} (known: {sorted(ADAPTERS)}): "
                        "it needs one implementing PositionAdapter")
