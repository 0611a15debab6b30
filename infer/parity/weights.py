"""The weights check of `infer.parity.check`: the checkpoint's own keys against what the model holds.

    problems = weight_problems(model, read_state_dict(dir))   # [] when every tensor is where it belongs

Independent of the loader: the table below is written from the release's key names
(docs/design/release.md 1.2: one row per kind of tensor, full-key patterns, each naming the attribute
path of the module this project puts it in), not from the loader's prefix rules
(`ReleaseCaptioner.release_rules`), and the comparison reads the model's own parameters
and buffers after loading. So a loader that maps a tensor to the wrong module (a swapped
pair of same-shaped heads, q into k) is caught, which comparing the loader's output with
its own inverse cannot do. Every file tensor must match exactly one row (or an ignore
row), every model tensor must be filled by exactly one file tensor (the tied `lm_head`
must share the embedding's storage instead), and each pair must be equal after the cast
to the model's dtype (bit-equal in fp32, the same rounding in bf16). Pure torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

LLM = "hf.model.language_model."
VISION = "hf.model.visual."
WHISPER = "audio.whisper."
QFORMER_LAYER = (r"(?:attention|crossattention)\.self\.(?:query|key|value)|(?:attention|crossattention)\.output\."
                 r"(?:dense|LayerNorm)|intermediate_query\.dense|output_query\.(?:dense|LayerNorm)")
WB = r"\.(weight|bias)"

# (release key, model attribute path): full-key patterns from the release's naming (docs/design/release.md 1.2)
TABLE: list[tuple[str, str]] = [
    (r"model\.embed_tokens\.weight", LLM + "embed_tokens.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj)" + WB, LLM + r"layers.\1.self_attn.\2.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", LLM + r"layers.\1.self_attn.o_proj.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", LLM + r"layers.\1.mlp.\2.weight"),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", LLM + r"layers.\1.\2.weight"),
    (r"model\.norm\.weight", LLM + "norm.weight"),
    (r"lm_head\.weight", "hf.lm_head.weight"),
    (r"visual\.patch_embed\.proj\.weight", VISION + "patch_embed.proj.weight"),
    (r"visual\.blocks\.(\d+)\.(norm1|norm2)\.weight", VISION + r"blocks.\1.\2.weight"),
    (r"visual\.blocks\.(\d+)\.attn\.(qkv|proj)" + WB, VISION + r"blocks.\1.attn.\2.\3"),
    (r"visual\.blocks\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)" + WB, VISION + r"blocks.\1.mlp.\2.\3"),
    (r"visual\.merger\.ln_q\.weight", VISION + "merger.ln_q.weight"),
    (r"visual\.merger\.mlp\.(0|2)" + WB, VISION + r"merger.mlp.\1.\2"),
    (r"audio\.(conv1|conv2|layer_norm)" + WB, WHISPER + r"\1.\2"),
    (r"audio\.embed_positions\.weight", WHISPER + "embed_positions.weight"),
    (r"audio\.layers\.(\d+)\.self_attn\.(q_proj|v_proj|out_proj)" + WB, WHISPER + r"layers.\1.self_attn.\2.\3"),
    (r"audio\.layers\.(\d+)\.self_attn\.k_proj\.weight", WHISPER + r"layers.\1.self_attn.k_proj.weight"),
    (r"audio\.layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm|fc1|fc2)" + WB, WHISPER + r"layers.\1.\2.\3"),
    (r"audio\.q_tokens", "audio.q_tokens"),
    (r"audio\.qformer\.bert\.embeddings\.LayerNorm" + WB, r"audio.qformer.bert.embeddings.LayerNorm.\1"),
    (r"audio\.qformer\.bert\.encoder\.layer\.(\d+)\.(" + QFORMER_LAYER + ")" + WB,
     r"audio.qformer.bert.encoder.layer.\1.\2.\3"),
    (r"audio\.audio_proj" + WB, r"audio.audio_proj.\1"),
    (r"frm_head\.(0|1|3)" + WB, r"frm_head.net.\1.\2"),
    (r"evi_head\.(0|1|3)" + WB, r"evi_head.net.\1.\2"),
]
# read and dropped on purpose: the unused score head, the Q-Former's position-id buffer
IGNORED = [r"score_head\.(0|1|3)" + WB, r"audio\.qformer\.bert\.embeddings\.position_ids"]
TIED = ("hf.lm_head.weight", LLM + "embed_tokens.weight")


def target_of(key: str) -> str | None:
    """The model path of a release key by the table ('' for an ignored key, None for an unknown one)."""
    if any(re.fullmatch(p, key) for p in IGNORED):
        return ""
    hits = [re.fullmatch(p, key).expand(dst) for p, dst in TABLE if re.fullmatch(p, key)]
    if len(hits) > 1:
        raise ValueError(f"{key}: more than one row of the weights table matches")
    return hits[0] if hits else None


def weight_problems(model, state: Mapping[str, torch.Tensor], limit: int = 4) -> list[str]:
    """What disagrees between the file's tensors and the model's (module doc); [] when nothing does."""
    # every parameter and persistent buffer the model holds, by attribute path (tied ones under both names)
    held = dict(model.named_parameters(remove_duplicate=False))
    held.update({k: v for k, v in model.state_dict(keep_vars=True).items() if k not in held})
    filled: dict[str, str] = {}
    unknown, wrong, duplicate = [], [], []
    for key, tensor in state.items():
        dst = target_of(key)
        if dst == "":
            continue
        if dst is None or dst not in held:
            unknown.append(f"{key} -> {dst}")
            continue
        if dst in filled:
            duplicate.append(f"{key} and {filled[dst]} -> {dst}")
            continue
        filled[dst] = key
        have = held[dst].detach().cpu()
        want = tensor.to(have.dtype) if tensor.is_floating_point() else tensor
        if have.shape != want.shape or not torch.equal(have, want):
            wrong.append(f"{key} != model {dst}")
    tied = TIED[0] in held and held[TIED[0]].data_ptr() == held[TIED[1]].data_ptr()
    missing = [k for k in held if k not in filled and not (k == TIED[0] and tied)]
    out = []
    for what, items in (("file tensors the table does not place", unknown), ("tensors placed twice", duplicate),
                        ("tensors that differ from the file", wrong), ("model tensors no file tensor fills", missing)):
        if items:
            out.append(f"{len(items)} {what}: {items[:limit]}")
    return out
