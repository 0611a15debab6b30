"""The published PadCaptioner checkpoint as a model this project decodes and fine-tunes.

    model = ReleaseCaptioner.from_release(dir, settings=ReleaseSettings(...))
    video = model.encode_video(pixel_values, grid_thw)    # [T*V, d]  (vision tower + merger)
    audio = model.encode_audio(mel)                       # [C*60, d] (Whisper + window Q-Former)

Parts (docs/design/release.md 1.2), mapped by key prefix onto HF 5.24 classes and our own modules:
  `model.*`   -> Qwen2_5_VLForConditionalGeneration.model.language_model (the LLM, M-RoPE)
  `visual.*`  -> ....model.visual (Qwen2.5-VL vision tower + merger)
  `audio.*`   -> ReleaseAudio (HF WhisperEncoder + the window Q-Former + audio_proj)
  `frm_head.*`, `evi_head.*` -> the segment and event grounding heads
  (pipeline/grounding.py GroundingHead: LayerNorm -> Linear(d, d/2) -> GELU -> Linear(d/2, d))
  ignored on purpose: `score_head.*` (unused by the release with use_score_head false) and
  the Q-Former's `position_ids` buffer; `lm_head.weight` is tied (absent from the file).
Every other tensor, missing one or wrong shape is an error that names it
(pipeline/release/checkpoint.py). `from_release` builds the modules with their parameters on
the meta device (no random init) and assigns the file's memory-mapped tensors, cast to the
settings' dtype where the file's differs, on the requested device. Token ids come from config.json and must agree with
the tokenizer saved beside it.

The model exposes what the decoding engine uses of a PadCaptioner (decoder, ids,
tokenizer, dtype/device, `step_tables`), so the release gets the same cascade,
many-videos-per-step decode (infer/engine/programs.py `ReleaseProgram` holds its front half).
Pure torch + HF; no ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from pipeline.backbone import DTYPES, cast_keeping_rope, position_adapter
from pipeline.config import ReleaseConfig
from pipeline.family import well_formed
from pipeline.grounding import GroundingHead, segment_hidden, similarity_logits
from pipeline.release.audio import ReleaseAudio
from pipeline.release.checkpoint import ReleaseError, is_release_dir, map_state_dict, read_state_dict
from pipeline.release.geometry import Geometry
from pipeline.release.layout import POSITION_MODES
from pipeline.release.video import use_window_attention
from pipeline.two_stage import run_decoder

AGGREGATIONS = ("release", "renormalised")
TOKENS = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "video": "<|video_pad|>",
          "audio": "<|audio_pad|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>", "g": "<G>", "s": "<S>",
          "shift": "<shift>", "pad": "<|endoftext|>"}
CONFIG_IDS = {"video": "video_token_id", "vision_start": "vision_start_token_id", "vision_end": "vision_end_token_id",
              "audio": "audio_token_id", "g": "evi_token_id", "s": "evi_end_token_id", "shift": "shift_token_id",
              "im_end": "eos_token_id"}
IGNORED_SUFFIXES = ("audio.qformer.bert.embeddings.position_ids",)
TOWERS = ("hf.model.visual.", "audio.")  # the model keys of the two media towers
RELEASE_TOWERS = ("visual.", "audio.")  # theirs in the release's file


@dataclass
class ReleaseSettings(ReleaseConfig):
    """Test-time settings of the release (they are not in its config.json): the run's `release` section
    (pipeline/config.py ReleaseConfig: positions, aggregation, grounding threshold 0.7 and merge gap 2,
    the instruction, max_seq_len 32768, where the release's prefill applies a sliding window that HF 5.24
    does not: longer prompts are refused) plus what a load decides.

    aggregation "release" = softmax over the attention probabilities (what the release does: nearly
    uniform), "renormalised" = the probabilities renormalised inside the interval (ours).
    max_events / max_branch_tokens: None = the checkpoint's fields, else the release's
    code defaults (30 / 320); a branch holds at most 1 + max_branch_tokens tokens.
    """

    max_events: int | None = None
    max_branch_tokens: int | None = None
    dtype: str = "float32"

    def check(self) -> None:
        if self.positions not in POSITION_MODES:
            raise ReleaseError(f"release positions {self.positions!r} not in {POSITION_MODES}")
        if self.aggregation not in AGGREGATIONS:
            raise ReleaseError(f"release aggregation {self.aggregation!r} not in {AGGREGATIONS}")
        if not 0.0 < self.grounding_threshold <= 1.0:
            raise ReleaseError(f"grounding_threshold must be in (0, 1], got {self.grounding_threshold}")
        if self.dtype not in DTYPES:
            raise ReleaseError(f"release dtype {self.dtype!r} not in {sorted(DTYPES)}")


def settings_from(cfg, *, positions: str | None = None) -> ReleaseSettings:
    """ReleaseSettings from a project Config (its `release` section, `model.dtype`)."""
    r = asdict(cfg.release)
    return ReleaseSettings(**{**r, "positions": positions or r["positions"]}, dtype=cfg.model.dtype)


class ReleaseCaptioner(nn.Module):
    """See the module docstring. Build with `from_release` (weights) or the constructor (random)."""

    source = ""  # the release directory `from_release` read ("" when built by the constructor)

    def __init__(self, hf_config, tokenizer, settings: ReleaseSettings | None = None):
        super().__init__()
        settings = settings or ReleaseSettings()
        settings.check()
        self.settings = settings
        self.hf_config = hf_config
        self.adapter = position_adapter(hf_config)  # M-RoPE (pipeline/backbone.py MRope)
        raw = hf_config.to_dict()
        text = hf_config.get_text_config(decoder=True)
        self.hf = Qwen2_5_VLForConditionalGeneration._from_config(hf_config, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        use_window_attention(self.visual)  # every window in a handful of SDPA calls (pipeline/release/video.py)
        d = text.hidden_size
        audio_cfg = raw.get("audio_config")
        self.audio = ReleaseAudio(audio_cfg, d) if audio_cfg else None
        self.frm_head = GroundingHead(d)  # the project's head; the release's keys map onto its `net`
        self.evi_head = GroundingHead(d)
        self.tokenizer = tokenizer
        self.ids = check_token_ids(hf_config, tokenizer)
        self.g_id, self.s_id, self.eos_id, self.pad_id = self.ids["g"], self.ids["s"], self.ids["eos"], self.ids["pad"]
        self.shift_id = self.ids["shift"]
        n_layers = text.num_hidden_layers
        self.aggregation_layer = int(raw.get("vision_audio_layer_index", n_layers // 2))
        if not 0 <= self.aggregation_layer < n_layers:
            raise ReleaseError(f"vision_audio_layer_index {self.aggregation_layer} outside [0, {n_layers})")
        self.audio_mean_weight = float(raw.get("audio_mean_weight", 1.0))
        self.geometry = Geometry.from_config(raw)  # patch / merge / temporal sizes, token rates (3B defaults)
        if self.audio is not None and self.audio.second_per_window != self.geometry.audio_seconds_per_token:
            raise ReleaseError(f"audio_config.second_per_window {self.audio.second_per_window} disagrees with the "
                               f"geometry's {self.geometry.audio_seconds_per_token}")
        self.max_events = int(settings.max_events or raw.get("max_planning_events", 30))
        self.max_branch_tokens = int(settings.max_branch_tokens or raw.get("max_branch_tokens", 320))
        if not raw.get("use_evidence", True) or raw.get("use_score_head", False) or raw.get("union_aggregation", False):
            raise ReleaseError("only the shipped evidence setting is supported (use_evidence true, use_score_head "
                               "false, union_aggregation false); this config.json asks for another")
        cast_keeping_rope(self, DTYPES[settings.dtype])  # rotary frequencies in fp32, as the release loads them

    # ------------------------------------------------------------------ building

    @classmethod
    def from_release(cls, path: str | Path, settings: ReleaseSettings | None = None,
                     device: str | torch.device | None = None, towers_only: bool = False) -> ReleaseCaptioner:
        """Load a release directory (config.json, weights, tokenizer), strictly (module doc), in the
        settings' dtype and on `device` (default CPU): the modules are built with their parameters on
        the meta device and the file's tensors (memory-mapped) become the parameters, cast only when
        the file's dtype differs, so host memory peaks near the checkpoint's size. towers_only: only the
        vision tower and the audio tower are loaded (what a featurize actor runs): only their keys are
        taken from the file (only their shards opened), the LLM and the heads stay on the meta device,
        never read nor moved to `device` (decoding with such a model fails)."""
        path = Path(path)
        if not is_release_dir(path):
            raise ReleaseError(f"{path} is not a PadCaptioner release directory (config.json of model_type "
                               "qwen2_5_vl with evi_token_id)")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        with init_empty_weights(include_buffers=False):  # parameters on the meta device: no random init
            model = cls(hf_config, tokenizer, settings)
        state = read_state_dict(path, prefixes=RELEASE_TOWERS if towers_only else None)  # towers: their keys alone
        model.load_release_state(state, device=device, towers_only=towers_only)
        model.source = str(path.resolve())
        return model

    def release_rules(self) -> list[tuple[str, str]]:
        return [("model.", "hf.model.language_model."), ("visual.", "hf.model.visual."), ("lm_head.", "hf.lm_head."),
                ("audio.q_tokens", "audio.q_tokens"), ("audio.qformer.", "audio.qformer."),
                ("audio.audio_proj.", "audio.audio_proj."), ("audio.", "audio.whisper."),
                ("frm_head.", "frm_head.net."), ("evi_head.", "evi_head.net.")]

    def load_release_state(self, state: dict[str, torch.Tensor], device: str | torch.device | None = None,
                           towers_only: bool = False) -> None:
        """Load release-named tensors strictly (a missing, unexpected or misshapen one raises). They are
        assigned as the parameters (cast to the model's dtype, moved to `device` when given), so a model
        built on the meta device is filled without a second copy."""
        targets = self.state_dict()
        ignore = [k for k in state if k.startswith("score_head.") or k.endswith(IGNORED_SUFFIXES)]
        optional = ["hf.lm_head.weight"] if self.tied else []
        if towers_only:
            targets = {k: v for k, v in targets.items() if k.startswith(TOWERS)}
            ignore += [k for k in state if not k.startswith(RELEASE_TOWERS)]
        mapped = map_state_dict(state, self.release_rules(), targets, ignore=ignore, optional=optional)
        here = self.tower_device if towers_only else self.device
        dev = torch.device(device) if device is not None else (None if here.type == "meta" else here)
        cast = {k: v.to(device=dev or v.device, dtype=targets[k].dtype if v.is_floating_point() else v.dtype)
                for k, v in mapped.items()}
        self.load_state_dict(cast, strict=False, assign=True)
        if self.tied and not towers_only:
            self.hf.tie_weights()
        for part in ([self.visual, self.audio] if towers_only else [self]):
            if dev is not None and part is not None:
                part.to(dev)  # the buffers computed at construction (rotary frequencies)
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()]
                if t.is_meta and (not towers_only or n.startswith(TOWERS))]
        if left:
            raise ReleaseError(f"{len(left)} tensor(s) the checkpoint did not fill: {left[:4]}")

    def release_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This model's tensors (or `state`, keyed as this model's) under the release's key names (what the
        release saves; tied head left out)."""
        inverse = [(dst, src) for src, dst in self.release_rules()]
        return {next(s + k[len(d):] for d, s in inverse if k.startswith(d)): v
                for k, v in (self.state_dict() if state is None else state).items()
                if not (k == "hf.lm_head.weight" and self.tied)}

    # ------------------------------------------------------------------ pieces the engine uses

    @property
    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False) or
                    getattr(self.hf_config.get_text_config(decoder=True), "tie_word_embeddings", False))

    @property
    def decoder(self) -> nn.Module:
        """The LLM (Qwen2_5_VLTextModel): layers, norm, rotary_emb, embed_tokens."""
        return self.hf.model.language_model

    @property
    def visual(self) -> nn.Module:
        return self.hf.model.visual

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        dev = self.decoder.embed_tokens.weight.device
        return self.tower_device if dev.type == "meta" else dev  # a towers-only model: where its towers are

    @property
    def tower_device(self) -> torch.device:
        """Where the vision tower is (a towers-only model has no LLM on a device)."""
        return self.visual.patch_embed.proj.weight.device

    @property
    def hidden_size(self) -> int:
        return self.decoder.embed_tokens.weight.shape[1]

    def step_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(embed [V, d], head [V, d], head bias) for the decode step: the release's rows are in the tables."""
        emb = self.decoder.embed_tokens.weight.detach()
        out = self.hf.lm_head.weight.detach()
        return emb, (emb if out.data_ptr() == emb.data_ptr() else out), self.hf.lm_head.bias

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids.to(self.device))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden)

    run_decoder = run_decoder  # the LLM with a layout mask made additive (pipeline/two_stage.py)

    def plan_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> [N, 2]: the (<G>, <S>) columns of `lm_logits` alone (a planning decision's)."""
        head = self.hf.lm_head
        ids = [self.g_id, self.s_id]
        bias = head.bias[ids] if head.bias is not None else None
        return torch.nn.functional.linear(hidden, head.weight[ids], bias)

    def segment_vectors(self, hidden: torch.Tensor, lay) -> torch.Tensor:
        """Grounding-layer states [L, d] -> per-timestep keys [T, d] (docs/design/release.md 4.4).

        frm_head on every AV token, then per timestep the mean over its video index set plus
        audio_mean_weight x the mean over its audio index set (zero for an empty set): the project's
        pooling (pipeline/grounding.py `segment_hidden`) after the head, where the project pools before it.
        """
        dev = hidden.device
        v = self.frm_head(hidden[lay.video_slots.to(dev)])
        a = self.frm_head(hidden[lay.audio_slots.to(dev)]) if lay.audio_slots.numel() else None
        return segment_hidden(v, lay.video_sets, None if a is None else lay.audio_sets, self.audio_mean_weight, a)

    def similarity(self, event: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """evi_head(state) [d] x segment keys [T, d] -> sigmoid similarities [T], in the model dtype."""
        return torch.sigmoid(similarity_logits(self.evi_head(event), segments, precision="inputs"))

    # ------------------------------------------------------------------ the family interface (pipeline/family.py)

    program = "release"  # the engine's program for this family (infer/engine/programs.py)
    baseline_decoder = None  # decoded by the engine alone

    def capture_layers(self) -> tuple[int, int]:
        """(grounding layer, aggregation layer) in HF's numbering: the release grounds on hidden_states[-2]."""
        return self.hf_config.get_text_config(decoder=True).num_hidden_layers - 1, self.aggregation_layer

    def banned_ids(self) -> list[int]:
        return [self.g_id, self.s_id, self.shift_id]

    def default_caps(self) -> tuple[int, int]:
        """The checkpoint's max_planning_events; 1 + max_branch_tokens (the first token comes from the anchor step)."""
        return self.max_events, self.max_branch_tokens + 1

    def engine_refusal(self, decoder: str) -> str | None:
        return None if decoder == "parallel" else "the release model decodes in parallel only (infer.decoder=parallel)"

    def final_intervals(self, intervals: list, duration: float) -> list:
        """The release's seconds are not clipped to the video: results are."""
        return [well_formed(s, e, duration, 1e-3) for s, e in intervals]

    def cast_to(self, dtype: torch.dtype) -> None:
        cast_keeping_rope(self, dtype)

    # ------------------------------------------------------------------ encoders

    @torch.no_grad()
    def encode_video(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3*2*14*14], grid_thw [1, 3] (patches) -> merged tokens [T*H'*W', d]."""
        vis, dev = self.visual, self.tower_device
        return vis(pixel_values.to(dev, vis.dtype), grid_thw=grid_thw.to(dev)).pooler_output

    @torch.no_grad()
    def encode_audio(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [C, 128, 3000] -> audio tokens [C*60, d] (2 per second of the audio stream)."""
        if self.audio is None:
            raise ReleaseError("this checkpoint has no audio tower (no audio_config)")
        return self.audio(mel.to(self.tower_device)).flatten(0, 1)

    def describe(self) -> dict:
        return {"kind": "release", **asdict(self.settings), "aggregation_layer": self.aggregation_layer,
                "max_events": self.max_events, "max_branch_tokens": self.max_branch_tokens}


def check_token_ids(hf_config, tokenizer) -> dict[str, int]:
    """The release's token ids from config.json, checked against the tokenizer (docs/design/release.md 1.2)."""
    raw = hf_config.to_dict()
    ids: dict[str, int] = {}
    wrong = []
    for name, token in TOKENS.items():
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            wrong.append(f"{token} is not in the tokenizer")
            continue
        ids[name] = int(tid)
        key = CONFIG_IDS.get(name)
        want = raw.get(key) if key else None
        if isinstance(want, list):
            want = want[0]
        if want is not None and int(want) != int(tid):
            wrong.append(f"{key}={want} in config.json but the tokenizer has {token}={tid}")
    if wrong:
        raise ReleaseError("config.json and tokenizer disagree: " + "; ".join(wrong))
    ids["eos"] = ids["im_end"]
    return ids
