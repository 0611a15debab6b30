"""PadCaptioner: an HF Qwen2-family causal LM with audio-visual projectors, <G>/<S>, grounding and aggregation.

    model = PadCaptioner(cfg.model, visual_dim=Dv, audio_dim=Da)
    batch = collate([model.make_example(sample, generator=g) for sample in samples])
    out = model.forward_train(batch)          # logits at labelled rows + grounding logits
    loss = train.losses.compute_losses(out, cfg.model)
    model.save_pretrained(dir); PadCaptioner.from_pretrained(dir)

What it owns (and what trains): LoRA adapters (peft) on `lora_targets`; the visual and
audio projectors (MLP Dv/Da -> d) plus a modality embedding and a segment-index (time)
embedding; the rows of the two new tokens <G>, <S>; the event and segment grounding
heads; the aggregation scorer (scoring_head mode). Everything else is frozen.

New token rows: a separate small parameter `new_embed` [2, d] (and `new_out` [2, d] when
the backbone's input and output embeddings are not tied) instead of a gradient hook on
the full embedding. The frozen vocab-size matrix then gets no gradient and no optimizer
state at all (a hook would leave it exposed to weight decay and cost two vocab x d Adam
buffers), and checkpoints hold two rows, not the matrix. `embed_tokens` substitutes the
rows for the <G>/<S> ids; `lm_logits` replaces those two logit columns.

Forward (training), per padded batch (pipeline.examples.Packed), two stages:
  1. columns [0, split): prefix + serial <G>s (or a whole plain sample), with a KV cache;
     planning logits, event vectors (grounding layer, rows that predict each <G>),
     segment vectors, and the aggregation layer's input states come from this pass;
  2. columns [split, L): anchors (<G> embedding + aggregated feature) and branches,
     attending to stage 1 through the cache with their own rows of the same mask.
Stage 2 depends on stage 1 only through the cache, so the two stages equal one packed
forward with the same mask (tested). Under activation checkpointing (HF drops caches
there) stage 2 reruns the full sequence instead (the steps both families share are
pipeline/two_stage.py's). Logits are computed only at labelled rows. The mask is always
an explicit additive float 4D mask.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, load_peft_weights, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer

from pipeline.aggregation import Aggregator, attention_row, interval_mask
from pipeline.anchor_attention import branch_anchor_pairs, own_anchor_mass
from pipeline.backbone import DTYPES, cast_keeping_rope, load_backbone, position_adapter
from pipeline.config import ModelConfig, from_dict
from pipeline.examples import TEXT_LAYOUTS, Batch, Example, collate, make_example
from pipeline.family import CheckpointFormat, Counting
from pipeline.fitting import fit_to_model
from pipeline.grounding import GroundingHead, readout, segment_hidden, similarity_logits, soft_targets
from pipeline.layout import IGNORE, LayoutOptions, Role, additive_mask
from pipeline.tokens import add_special_tokens, build_tokenizer, prompt_ids, special_ids
from pipeline.two_stage import run_decoder, stage_cache, stage_two, train_outputs
from pipeline.weights import fold_rows, with_row_logits, with_rows

FORMAT_VERSION = 1
META_FILE = "padcaptioner.json"
EXTRA_FILE = "extra.safetensors"
NEW_TOKEN_NOISE = 0.1
"""The new <G>/<S> rows start at the mean embedding row + noise of this many embedding stds."""


class ModelError(ValueError):
    """The model cannot be built / loaded as asked; the message says why."""


class Projector(nn.Module):
    """Linear(D, d) -> GELU -> Linear(d, d); the last layer starts at the LM's init scale."""

    def __init__(self, in_dim: int, dim: int, init_std: float = 0.02):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, dim), nn.GELU(), nn.Linear(dim, dim))
        nn.init.normal_(self.net[2].weight, std=init_std)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[0].weight.dtype))


class PadCaptioner(nn.Module):
    """See the module docstring."""

    def __init__(self, cfg: ModelConfig, tokenizer=None, *, visual_dim: int = 0, audio_dim: int = 0):
        super().__init__()
        cfg = copy.deepcopy(cfg)
        cfg.visual_dim = visual_dim or cfg.visual_dim
        cfg.audio_dim = audio_dim or cfg.audio_dim
        if cfg.visual_dim <= 0 or cfg.audio_dim <= 0:
            raise ModelError("model.visual_dim / model.audio_dim unknown: set them or pass the shard feature dims")
        self.cfg = cfg
        self.options = LayoutOptions.from_config(cfg)
        self.tokenizer = add_special_tokens(tokenizer) if tokenizer is not None else build_tokenizer(cfg)
        self.ids = ids = special_ids(self.tokenizer)
        self.g_id, self.s_id, self.eos_id, self.pad_id = ids["g"], ids["s"], ids["eos"], ids["pad"]
        self.prompt = prompt_ids(self.tokenizer, cfg.instruction)

        base, self.base_ref = load_backbone(cfg, vocab_size=len(self.tokenizer))
        self.adapter = position_adapter(base.config)
        n_layers = base.config.num_hidden_layers
        self.aggregation_layer = n_layers // 2 if cfg.aggregation_layer == -1 else cfg.aggregation_layer
        if not 0 <= self.aggregation_layer < n_layers:
            raise ModelError(f"model.aggregation_layer={cfg.aggregation_layer} outside [0, {n_layers})")
        self.anchor_guide_layer = 0  # the hidden states the anchor guide reads (model.anchor_guide_weight > 0)
        if not -(n_layers + 1) <= cfg.grounding_layer <= n_layers:
            raise ModelError(f"model.grounding_layer={cfg.grounding_layer} outside the {n_layers + 1} hidden states")
        for p in base.parameters():
            p.requires_grad_(False)
        in_w = base.get_input_embeddings().weight
        out_w = base.get_output_embeddings().weight
        tied = in_w.data_ptr() == out_w.data_ptr()
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_targets), bias="none")
        with warnings.catch_warnings():  # peft 0.21 reads the deprecated `is_gradient_checkpointing`
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self.backbone = get_peft_model(base, lora)
        if cfg.train_backbone_embeddings:
            in_w.requires_grad_(True)
            out_w.requires_grad_(True)

        d = base.config.hidden_size
        dtype = DTYPES[cfg.dtype]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.backbone_seed + 1)
            noise = in_w.detach().float().std().item() * NEW_TOKEN_NOISE

            def rows(w: torch.Tensor) -> nn.Parameter:
                return nn.Parameter((w.detach().float().mean(0).repeat(2, 1) + noise * torch.randn(2, d)).to(dtype))

            self.new_embed = rows(in_w)
            self.new_out = None if tied else rows(out_w)
            self.visual_proj = Projector(cfg.visual_dim, d)
            self.audio_proj = Projector(cfg.audio_dim, d)
            self.modality_embed = nn.Embedding(2, d)
            self.time_embed = nn.Embedding(cfg.max_segments, d)
            nn.init.normal_(self.modality_embed.weight, std=0.02)
            nn.init.normal_(self.time_embed.weight, std=0.02)
            self.event_head = GroundingHead(d)
            self.segment_head = GroundingHead(d)
            self.aggregator = Aggregator(cfg.aggregation, d)
        for name, module in self.named_children():
            if name != "backbone":
                module.to(dtype)
        self.register_buffer("new_ids", torch.tensor([self.g_id, self.s_id]), persistent=False)

    # ------------------------------------------------------------------ pieces the engine uses

    @property
    def decoder(self) -> nn.Module:
        """The backbone's base model (Qwen2Model, LoRA injected): layers, norm, rotary_emb."""
        return self.backbone.get_base_model().model

    @property
    def hf_config(self):
        return self.backbone.get_base_model().config

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the decoder computes in: its embedding table's, not the config's (DeepSpeed
        bf16 casts the weights of a float32-config model, and the mask must follow them)."""
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.new_embed.device

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., d]; <G>/<S> from `new_embed`; negative ids (feature slots) give zeros' row 0."""
        return with_rows(self.decoder.embed_tokens(ids.clamp(min=0)), ids, self.new_ids, self.new_embed)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> [N, V]: frozen LM head, with the <G>/<S> columns from the new rows."""
        return with_row_logits(self.backbone.get_base_model().lm_head(hidden), hidden, self.new_ids,
                               self.new_embed if self.new_out is None else self.new_out)

    def plan_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d] -> [N, 2]: the (<G>, <S>) logits alone, the columns of `lm_logits` a planning
        decision reads (the engine takes them for every decision row of a step at once)."""
        out_rows = self.new_embed if self.new_out is None else self.new_out
        return hidden @ out_rows.to(hidden.dtype).T

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """A layout mask (0 / hidden) -> the same mask in the model dtype with finfo(dtype).min."""
        return additive_mask(mask == 0, self.dtype)

    def position_ids(self, packed, cols: slice = slice(None)) -> torch.Tensor:
        return self.adapter.position_ids(packed.position[:, cols], packed.segment[:, cols], packed.role[:, cols])

    def feature_embeddings(self, ex: Example) -> tuple[torch.Tensor, torch.Tensor]:
        """-> visual [T*V, d], audio [T*A, d]: projector + modality + segment-index embeddings."""
        dev = self.device
        t = ex.visual.shape[0]
        seg_v = torch.arange(t, device=dev).repeat_interleave(ex.visual.shape[1])
        vis = self.visual_proj(ex.visual.to(dev).flatten(0, 1)) + self.modality_embed.weight[0] + self.time_embed(seg_v)
        seg_a = torch.arange(t, device=dev).repeat_interleave(ex.audio.shape[1])
        aud = self.audio_proj(ex.audio.to(dev).flatten(0, 1)) + self.modality_embed.weight[1] + self.time_embed(seg_a)
        return vis, aud

    def embed(self, packed, examples: list[Example], cols: slice = slice(None)) -> torch.Tensor:
        """Input embeddings [B, n, d] of the batch columns `cols`: token rows, feature slots
        spliced in; anchors get the bare <G> embedding (add `anchor_features` yourself)."""
        ids = packed.input_ids[:, cols].to(self.device)
        role = packed.role[:, cols].to(self.device)
        slot = packed.slot[:, cols].to(self.device)
        emb = self.embed_tokens(ids)
        for b, ex in enumerate(examples):
            is_v, is_a = role[b] == Role.VISUAL, role[b] == Role.AUDIO
            if not (is_v.any() or is_a.any()):
                continue
            vis, aud = self.feature_embeddings(ex)
            emb[b, is_v] = vis[slot[b, is_v]].to(emb.dtype)
            emb[b, is_a] = aud[slot[b, is_a]].to(emb.dtype)
        return emb

    run_decoder = run_decoder  # the method is two_stage.run_decoder itself (self = its model), as in ReleaseCaptioner

    def event_vectors(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[K, d] grounding-layer states at the rows that predict each <G> -> event vectors [K, d]."""
        return self.event_head(hidden_rows)

    def segment_vectors(self, hidden: torch.Tensor, visual_index: torch.Tensor, audio_index: torch.Tensor) -> torch.Tensor:
        """grounding-layer states [S, d] -> segment vectors [T, d]."""
        return self.segment_head(segment_hidden(hidden, visual_index, audio_index))

    def grounding_logits(self, hidden: torch.Tensor, layout) -> torch.Tensor:
        """Grounding-layer states [S, d] of one sample (layout indices) -> logits [K, T]."""
        ev = self.event_vectors(hidden[layout.event_query_index.to(hidden.device)])
        seg = self.segment_vectors(hidden, layout.visual_index.to(hidden.device), layout.audio_index.to(hidden.device))
        return similarity_logits(ev, seg)

    def ground(self, logits: torch.Tensor, segment_times: torch.Tensor) -> list[tuple[float, float]]:
        """[K, T] logits -> K (start, end) intervals with the configured threshold and gap."""
        return readout(logits, segment_times, self.cfg.grounding_threshold, self.cfg.grounding_merge_gap)

    def aggregation_row(self, hidden_in: torch.Tensor, layout, position_ids: torch.Tensor,
                        key_visible: torch.Tensor) -> torch.Tensor | None:
        """The attention row [S] that weighs the prefix for the anchors (aggregation = attention; else
        None): the last instruction token's head-averaged attention at `aggregation_layer`. It depends
        on the prefix only, so a decoder takes it once, when the prefix is done."""
        if self.cfg.aggregation != "attention":
            return None
        return attention_row(self.decoder, self.aggregation_layer, self.adapter, hidden_in,
                             position_ids.to(hidden_in.device), layout.instruction_end, key_visible.to(hidden_in.device))

    def anchor_features(self, hidden_in: torch.Tensor, layout, segment_times: torch.Tensor, intervals: torch.Tensor,
                        position_ids: torch.Tensor, key_visible: torch.Tensor, row: torch.Tensor | None = None):
        """Aggregated features [K, d] (and the weights) for one sample.

        hidden_in [S, d]: input states of layer `aggregation_layer` over the sample's stage-1
        tokens (layout indices); position_ids [S]; key_visible bool [S]: keys the last
        instruction token sees; intervals [K, 2] seconds; row: `aggregation_row`'s, when already taken.
        """
        inside = interval_mask(intervals.cpu(), segment_times.cpu()).to(hidden_in.device)
        if row is None:
            row = self.aggregation_row(hidden_in, layout, position_ids, key_visible)
        return self.aggregator(hidden_in, layout.visual_index.to(hidden_in.device), layout.audio_index.to(hidden_in.device),
                               inside, row)

    def anchor_embeddings(self, hidden_in, layout, segment_times, intervals, position_ids, key_visible,
                          row: torch.Tensor | None = None) -> torch.Tensor:
        """[K, d]: <G> embedding + aggregated feature (see `anchor_features`)."""
        feats, _ = self.anchor_features(hidden_in, layout, segment_times, intervals, position_ids, key_visible, row)
        g = self.embed_tokens(torch.tensor([self.g_id], device=hidden_in.device))
        return g + feats.to(g.dtype)

    # ------------------------------------------------------------------ training forward

    def make_example(self, sample, generator: torch.Generator | None = None, response: str | None = None,
                     with_targets: bool = True) -> Example:
        return make_example(sample, self.prompt, self.ids, self.tokenizer, self.cfg, generator=generator,
                            response=response, with_targets=with_targets)

    def forward_train(self, batch: Batch) -> dict:
        """Two-stage forward (module docstring; the shared steps are pipeline/two_stage.py's) -> the dict of
        `train_outputs`: text_logits / text_labels at stage 1's labelled rows (planning <G>/<S>, plain
        responses), branch_logits / branch_labels / branch_pad at stage 2's, grounding_logits /
        grounding_targets ([K_b, T_b] per sample with events), aggregation_weights (per sample with
        events: {"visual"/"audio": [K, T*M]}), anchor_mass when the anchor guide is on."""
        pk, exs = batch.packed, batch.examples
        s = pk.split
        dev = self.device
        pos = self.position_ids(pk).to(dev)
        labels = pk.labels.to(dev)
        emb1 = self.embed(pk, exs, slice(0, s))
        cache = stage_cache(self)
        out1 = self.run_decoder(emb1, pk.mask[:, :, :s, :s], pos[:, :s], cache=cache, output_hidden_states=True)
        hs = out1.hidden_states
        rows1 = labels[:, :s] != IGNORE
        text = (self.lm_logits(out1.last_hidden_state[rows1]), labels[:, :s][rows1])
        lists = {"grounding_logits": [], "grounding_targets": [], "aggregation_weights": []}
        hg, h_agg = hs[self.cfg.grounding_layer], hs[self.aggregation_layer]
        anchor_feats = []
        for b, ex in enumerate(exs):
            lay = ex.layout
            if lay.num_events == 0:
                continue
            lists["grounding_logits"].append(self.grounding_logits(hg[b], lay))
            lists["grounding_targets"].append(soft_targets(ex.intervals, ex.segment_times).to(dev))
            keys = pk.mask[b, 0, lay.instruction_end, :s].to(dev) == 0
            feats, weights = self.anchor_features(h_agg[b], lay, ex.segment_times, ex.agg_intervals, pos[b, :s], keys)
            anchor_feats.append((b, feats))
            lists["aggregation_weights"].append(weights)
        if pk.input_ids.shape[1] == s:
            return train_outputs(self.lm_logits, *text, **lists)
        emb2 = self.embed(pk, exs, slice(s, None))
        for b, feats in anchor_feats:
            cols = pk.columns[b][exs[b].layout.anchor_index].to(dev) - s  # anchors' stage-2 columns
            emb2[b, cols] = emb2[b, cols] + feats.to(emb2.dtype)
        guide = self.cfg.anchor_guide_weight > 0
        two = stage_two(self, emb1, emb2, lambda a: pk.mask[:, :, a:, :], pos, cache, output_hidden_states=guide)
        if guide:
            rows, anchors = branch_anchor_pairs(pk, [ex.layout for ex in exs], s)
            lists["anchor_mass"] = own_anchor_mass(self.decoder, self.anchor_guide_layer, self.adapter,
                                                   two.whole(self.anchor_guide_layer, hs), pos, pk.mask.to(dev),
                                                   rows.to(dev), anchors.to(dev))
        lab2 = labels[:, s:]
        rows2 = lab2 != IGNORE
        pad = (pk.input_ids[:, s:].to(dev) == self.eos_id) & (pk.role[:, s:].to(dev) == Role.BRANCH)
        return train_outputs(self.lm_logits, *text, (two.last[rows2], lab2[rows2], pad[rows2]), **lists)

    # ------------------------------------------------------------------ the family interface (pipeline/family.py)

    program = "pad"  # the engine's program for this family (infer/engine/programs.py)
    checkpoint = CheckpointFormat()  # padcaptioner.json beside the weights; written at every checkpoint
    counting: Counting = "tokens"  # held-out counts per token and attribute word from the packed batch

    @property
    def decoding_model(self) -> PadCaptioner:
        return self

    def capture_layers(self) -> tuple[int, int]:  # (grounding, aggregation) in HF's hidden-state numbering
        n_layers = self.hf_config.get_text_config(decoder=True).num_hidden_layers
        return self.cfg.grounding_layer % (n_layers + 1), self.aggregation_layer

    def step_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(embed [V, d], head [V, d], head bias): copies of the backbone's tables with the <G>/<S> rows
        of `new_embed` / `new_out` folded in (one tensor when tied)."""
        base = self.backbone.get_base_model()
        in_w, out_w = base.get_input_embeddings().weight, base.get_output_embeddings().weight
        embed = fold_rows(in_w, self.new_ids, self.new_embed)
        if in_w.data_ptr() == out_w.data_ptr() and self.new_out is None:
            head = embed
        else:
            head = fold_rows(out_w, self.new_ids, self.new_embed if self.new_out is None else self.new_out)
        return embed, head, getattr(base.get_output_embeddings(), "bias", None)

    def banned_ids(self) -> list[int]:
        return [self.g_id, self.s_id]

    def default_caps(self) -> tuple[int, int]:
        return 30, int(self.cfg.max_caption_tokens) + 1  # 30 events, and what training teaches

    @property
    def baseline_decoder(self) -> str | None:
        """The oracle an ablation model decodes with instead of the engine (infer/oracles/ablation.py)."""
        if self.cfg.layout in TEXT_LAYOUTS:
            return "text_chain"
        if self.cfg.layout == "chain":
            return "monolithic"
        if self.options.mask != "factorized" or self.options.g_visibility != "all":
            return "layout_ordered"
        return None

    def engine_refusal(self, decoder: str) -> str | None:
        """Why the engine cannot decode this model with infer.decoder=`decoder` (None: it can); its
        single-chain path (monolithic) runs `baseline_decoder` in the model's own layout."""
        layout, o = self.cfg.layout, self.options
        if layout in TEXT_LAYOUTS:
            return (f"model.layout={layout} writes its events as text: decode it with infer.oracles.ablation.text_chain "
                    "and score the text with the metrics (pipeline/textual.py parses it)")
        if decoder == "parallel" and (o.mask != "factorized" or o.g_visibility != "all"):
            return (f"parallel decoding needs a model trained with the factorized mask and global <G> visibility "
                    f"(model.mask={o.mask!r}, model.g_visibility={o.g_visibility!r}); use "
                    "infer.decoder=monolithic (the single-chain path decodes it in its training layout, infer/oracles/ablation.py)")
        return None

    def final_intervals(self, intervals: list, duration: float) -> list:
        return intervals  # already clipped to the video by the readout

    def cast_to(self, dtype: torch.dtype) -> None:
        cast_keeping_rope(self, dtype)
        self.cfg.dtype = {v: k for k, v in DTYPES.items()}[dtype]

    def collate(self, examples: list[Example]) -> Batch:
        return collate(examples)

    def fit(self, sample) -> tuple:
        return fit_to_model(sample, self)

    # ------------------------------------------------------------------ parameters and checkpoints

    def enable_activation_checkpointing(self) -> None:
        """Checkpoint every decoder layer (non-reentrant); stage 2 then reruns the full sequence."""
        self.backbone.get_base_model().activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Everything PadCaptioner adds outside the backbone (projectors, heads, new rows, scorer)."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("backbone.")}
        if self.cfg.train_backbone_embeddings:
            base = self.backbone.get_base_model()
            in_w, out_w = base.get_input_embeddings().weight, base.get_output_embeddings().weight
            state["backbone_embed_tokens"] = in_w
            if out_w.data_ptr() != in_w.data_ptr():  # tied: one matrix
                state["backbone_lm_head"] = out_w
        return state

    def save_pretrained(self, path: str | Path) -> Path:
        """dir/: padcaptioner.json (config + base reference), tokenizer/, adapter/ (peft), extra.safetensors."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"format_version": FORMAT_VERSION, "model": dataclasses.asdict(self.cfg), "base": self.base_ref}
        (path / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        self.tokenizer.save_pretrained(str(path / "tokenizer"))
        self.backbone.save_pretrained(str(path / "adapter"), save_embedding_layers=False)
        sort_target_modules(path / "adapter" / "adapter_config.json")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.extra_state().items()}, str(path / EXTRA_FILE))
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides) -> PadCaptioner:
        """Rebuild the base (preset + seed, or local path), then load tokenizer, LoRA and extras.

        overrides: ModelConfig fields to change at load time (e.g. attn_implementation).
        """
        path = Path(path)
        if not (path / META_FILE).exists():
            raise ModelError(f"{path} is not a PadCaptioner checkpoint (no {META_FILE})")
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ModelError(f"{path}: checkpoint format {meta.get('format_version')}, expected {FORMAT_VERSION}")
        cfg = from_dict(ModelConfig, {**meta["model"], **overrides})
        base = meta["base"]
        if base["kind"] == "path" and cfg.backbone != base["path"] and not Path(cfg.backbone).exists():
            raise ModelError(f"{path}: base model directory {cfg.backbone} is missing")
        tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        model = cls(cfg, tokenizer=tokenizer)
        adapter = load_peft_weights(str(path / "adapter"), device="cpu")
        result = set_peft_model_state_dict(model.backbone, adapter)
        if getattr(result, "unexpected_keys", None):
            raise ModelError(f"{path}: adapter has unexpected keys {result.unexpected_keys[:3]}")
        extra = load_file(str(path / EXTRA_FILE))
        base_model = model.backbone.get_base_model()
        for key, mod in (("backbone_embed_tokens", base_model.get_input_embeddings()), ("backbone_lm_head", base_model.get_output_embeddings())):
            if key in extra:
                mod.weight.data.copy_(extra.pop(key))
        missing, unexpected = model.load_state_dict(extra, strict=False)
        missing = [k for k in missing if not k.startswith("backbone.")]
        if missing or unexpected:
            raise ModelError(f"{path}: extra weights mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
        return model


def sort_target_modules(config_file: Path) -> None:
    """Write peft's adapter config with `target_modules` sorted.

    peft keeps `target_modules` as a set and writes it in string-hash order, which changes with
    PYTHONHASHSEED: the same model would be saved as different bytes by two processes, and its
    model_id (a hash of the saved files, infer/loading.py) would differ with it.
    """
    conf = json.loads(config_file.read_text())
    if isinstance(conf.get("target_modules"), list):
        conf["target_modules"] = sorted(conf["target_modules"])
    config_file.write_text(json.dumps(conf, indent=2, sort_keys=True))
