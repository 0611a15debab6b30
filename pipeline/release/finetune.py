"""Fine-tuning the published release model: LoRA on its LLM's q/k/v, heads and the <G>/<S> rows.

    tuner = ReleaseFinetune(ReleaseCaptioner.from_release(dir, settings), lora_r=128, lora_alpha=256)
    ex = tuner.make_example(TrainVideo(video, events))
    out = tuner.forward_train(tuner.collate([ex]))   # the dict train/losses.py reads
    tuner.save_pretrained(out_dir)                     # a release-format directory again

What trains, as the release trains (docs/design/release.md 1.1): LoRA (r 128, alpha 256 upstream) on
`q_proj/k_proj/v_proj` of the LLM only (not Whisper's, not the vision tower's `qkv`),
the grounding heads (`frm_head`, `evi_head`) and the rows of <G> and <S> (a separate
[2, d] parameter substituted into the embedding table and the tied head, so the
vocab-size matrix gets no gradient and no optimizer state). Everything else is frozen.

The training sequence of one video is the decoding layout (pipeline/release/layout.py) with
the ground truth in place, M-RoPE ids in the settings' mode (`training` is what the
release trained with):
  prompt (L tokens, causal + AV bidirectional) | serial <G>_1..<G>_K | anchors_1..K |
  branch 1 captions | ... | branch K captions
  serial <G>_k input = E[<G>] + agg(gt interval k), at L + k - 1 + delta;
  anchor j = E[<G>] + agg(gt interval j) at A = L + K + delta; branch j token r at A + r;
  branch rows see the prompt, every serial <G> and their own branch only.
Labels: the last prompt row and each serial <G> row predict the next planning token
(<G>, ..., <S>); each branch row predicts its next caption token, the last one
<|im_end|>. Grounding: the event vector of the row that predicts <G>_k against the
segment keys, BCE with the soft targets of pipeline/grounding.py. Intervals are mapped
to timesteps [floor(s / d), ceil(e / d) - 1]. Two forwards per video: the prompt (decoding's
own `prefill`, pipeline/release/decoding.py, whose states feed aggregation), then the rest through
its cache, with the positions (`shared_position` / `anchor_position` / `branch_position`
plus the rope delta) and the mask (`mask_between`) of pipeline/layout.py. Pure torch + HF + peft.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from pipeline.family import CheckpointFormat, Counting
from pipeline.grounding import similarity_logits, soft_targets
from pipeline.layout import Role, TokenMeta, anchor_position, branch_position, cat_meta, shared_position
from pipeline.release.grounding import aggregate, find_and_merge
from pipeline.release.layout import event_meta, prompt_meta, release_visible, shared_meta
from pipeline.release.model import ReleaseCaptioner, settings_from
from pipeline.release.video import ReleaseVideo, as_release_video
from pipeline.schema import Event
from pipeline.two_stage import stage_cache, stage_two, train_outputs
from pipeline.weights import effective_linear, fold_rows, with_row_logits, with_rows

LLM_QKV = r".*language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)"
RUN_CONFIG = "run_config.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.json", "preprocessor_config.json", "chat_template.json")


@dataclass
class TrainVideo:
    """A video with its ground-truth events (seconds; chronological order is used)."""

    video: ReleaseVideo
    events: list[Event]


@dataclass
class ReleaseExample:
    video: ReleaseVideo
    steps: list[tuple[int, int]]  # gt timestep interval per event
    intervals: torch.Tensor  # [K, 2] seconds
    captions: list[list[int]]  # caption ids per event, <|im_end|> appended
    num_tokens: int


@dataclass
class ReleaseBatch:
    examples: list[ReleaseExample]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.examples)


@dataclass
class LossSettings:
    """What train/losses.py reads of a model config."""

    grounding_loss_weight: float = 5.0
    branch_loss_weight: float = 1.0


def timestep_interval(start: float, end: float, d: float, timesteps: int) -> tuple[int, int]:
    a = min(max(int(math.floor(start / d)), 0), timesteps - 1)
    b = min(max(int(math.ceil(end / d)) - 1, a), timesteps - 1)
    return a, b


class ReleaseFinetune(nn.Module):
    """See the module docstring."""

    def __init__(self, model: ReleaseCaptioner, lora_r: int = 128, lora_alpha: int = 256, lora_dropout: float = 0.0,
                 max_caption_tokens: int = 256, grounding_loss_weight: float = 5.0):
        super().__init__()
        self.model = model
        self.cfg = LossSettings(grounding_loss_weight)
        self.max_caption_tokens = max_caption_tokens
        for p in model.parameters():
            p.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                           target_modules=LLM_QKV, bias="none"), model.hf)
        for n, p in model.hf.named_parameters():
            p.requires_grad_("lora_" in n)
        for mod in (model.frm_head, model.evi_head):
            mod.requires_grad_(True)
        self.row_ids = torch.tensor([model.g_id, model.s_id])
        table = model.decoder.embed_tokens.weight
        self.rows = nn.Parameter(table.detach()[self.row_ids].clone())

    # ------------------------------------------------------------------ what the loop uses

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return with_rows(self.model.embed_tokens(ids), ids, self.row_ids, self.rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return with_row_logits(self.model.lm_logits(hidden), hidden, self.row_ids, self.rows)

    def enable_activation_checkpointing(self) -> None:
        """Checkpoint every layer of the LLM, the vision tower and Whisper (non-reentrant). The towers
        are frozen and run without gradients when training, so there it saves nothing; with the LLM
        checkpointed, stage 2 reruns the prompt instead of reading its cache (HF drops caches then)."""
        kwargs = {"use_reentrant": False}
        self.model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        if self.model.audio is not None:
            self.model.audio.whisper.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)

    # the run's config beside the release's own config.json; checkpoints keep the trained tensors only, the
    # merged dir is train/export.py's (train/checkpoint.py)
    checkpoint = CheckpointFormat(config_file=RUN_CONFIG, merged_at_end=True)
    counting: Counting = "loss"  # free-text captions: held-out counts from the loss dict, no attribute words

    @property
    def decoding_model(self) -> ReleaseCaptioner:
        return self.model

    def collate(self, examples: list[ReleaseExample]) -> ReleaseBatch:
        return ReleaseBatch(list(examples))

    def fit(self, sample):
        """Samples are not shortened (the release's test path does not either): a prompt over
        settings.max_seq_len is refused by the forward (decoding's prefill_inputs raises DecodeError, as it
        does for a bad duration or features that do not fit the grid). -> (sample, cut=False)."""
        return sample, False

    def make_example(self, sample, generator=None) -> ReleaseExample:
        """A TrainVideo, or a stored schema-2 Sample of the release encoders with its events."""
        if not isinstance(sample, TrainVideo):
            sample = TrainVideo(as_release_video(sample, self.model.geometry), list(sample.events))
        v, m = sample.video, self.model
        if not sample.events:
            raise ValueError(f"{v.video_id}: no events to train on")
        t = v.num_segments
        events = sorted(sample.events, key=lambda e: (e.start, e.end))
        steps = [timestep_interval(e.start, e.end, v.seconds_per_step, t) for e in events]
        caps = [m.tokenizer(e.caption, add_special_tokens=False)["input_ids"][: self.max_caption_tokens] + [m.eos_id]
                for e in events]
        iv = torch.tensor([[e.start, e.end] for e in events], dtype=torch.float32).reshape(-1, 2)
        return ReleaseExample(v, steps, iv, caps, num_tokens=len(events) * 2 + sum(map(len, caps)))

    # ------------------------------------------------------------------ forward

    def forward_one(self, ex: ReleaseExample) -> dict:
        """The two-stage forward of one video (module doc; the shared steps are pipeline/two_stage.py's)."""
        from pipeline.release.decoding import prefill, seconds  # decoding's prefill; the one timestep -> seconds rule

        m = self.model
        dev = m.device
        cache = stage_cache(m)
        pre = prefill(m, ex.video, cache, embed=self.embed)
        lay, k = pre.layout, len(ex.steps)
        L = lay.length
        plan_labels = torch.tensor([m.g_id] * k + [m.s_id], device=dev)
        if k == 0:
            return train_outputs(self.logits, self.logits(pre.last_hidden[None]), plan_labels)
        # stage 2: serial <G>s, anchors, branches in one forward through the prompt's cache
        g = self.embed(torch.tensor([m.g_id], device=dev))[0]
        s = m.settings
        serial = torch.stack([g + aggregate(pre.attn_row, pre.h_agg, lay, st, s.aggregation, m.audio_mean_weight)
                              for st in ex.steps])  # [K, d]; anchor j's input is serial <G>_j's
        branch_inputs, branch_labels = [cap[:-1] for cap in ex.captions], [t for cap in ex.captions for t in cap]
        flat = torch.tensor([t for b in branch_inputs for t in b], dtype=torch.long, device=dev)
        tok_emb = self.embed(flat) if flat.numel() else pre.inputs_embeds.new_zeros(0, pre.inputs_embeds.shape[1])
        # branch j's rows: its anchor then its caption tokens but the last
        rows, r_owner, r_step = [], [], []
        offset = 0
        for j, b in enumerate(branch_inputs):
            rows += [serial[j:j + 1], tok_emb[offset:offset + len(b)]]
            offset += len(b)
            r_owner += [j] * (len(b) + 1)
            r_step += list(range(len(b) + 1))
        a_pos = anchor_position(L, k, pre.delta)
        p2 = torch.tensor([shared_position(L + i, pre.delta) for i in range(k)] +
                          [branch_position(a_pos, st) for st in r_step], device=dev)
        # the project's visibility rule: serial <G>s shared and causal, branch j sees them and its own rows
        meta = cat_meta(prompt_meta(lay), shared_meta(k, L, Role.SERIAL_G), event_meta(L + k, k, r_owner, r_step, "blocked"))
        hidden = lambda a: ~release_visible(TokenMeta(meta.order[a:], meta.role[a:], meta.event[a:]), meta)[None, None]
        two = stage_two(m, pre.inputs_embeds[None], torch.cat([serial] + rows)[None], hidden,
                        torch.cat([pre.positions.to(dev), p2.expand(3, -1)], 1)[:, None], cache, output_hidden_states=True)
        h2 = two.last[0]
        event_rows = torch.cat([pre.last_ground[None], two.layer(-2)[0, :k - 1]])
        logits = similarity_logits(m.evi_head(event_rows), pre.segments, precision="product")
        d = ex.video.seconds_per_step
        times = torch.tensor([seconds((t, t), d) for t in range(lay.grid.timesteps)])
        with torch.no_grad():  # the read-out intervals, for the held-out numbers (train/evaluate.py loss_counts)
            steps = [find_and_merge(torch.sigmoid(row), s.grounding_threshold, s.grounding_merge_gap) for row in logits]
            grounded = [([seconds(step, d) for step in steps], ex.intervals.tolist())]
        labels = torch.tensor(branch_labels, device=dev)
        return train_outputs(self.logits, self.logits(torch.cat([pre.last_hidden[None], h2[:k]])), plan_labels,
                             (h2[k:], labels, torch.zeros_like(labels, dtype=torch.bool)), grounding_logits=[logits],
                             grounding_targets=[soft_targets(ex.intervals, times).to(dev)], grounded=grounded)

    def forward_train(self, batch: ReleaseBatch) -> dict:
        """One forward per video; outputs concatenated (the dict compute_losses reads)."""
        outs = [self.forward_one(ex) for ex in batch.examples]
        cat = {k: torch.cat([o[k] for o in outs]) for k in ("text_logits", "text_labels", "branch_logits",
                                                            "branch_labels", "branch_pad")}
        for k in ("grounding_logits", "grounding_targets", "aggregation_weights", "grounded"):
            cat[k] = [x for o in outs for x in o.get(k, [])]
        return cat

    # ------------------------------------------------------------------ saving

    @torch.no_grad()
    def merged_release_state(self) -> dict[str, torch.Tensor]:
        """The release's key names with LoRA merged and the trained rows folded in (what it saves)."""
        m = self.model
        state = {k.replace(".base_layer.", "."): v for k, v in m.state_dict().items() if "lora_" not in k}
        for name, mod in m.named_modules():
            if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
                w, b = effective_linear(mod)
                state[f"{name}.weight"] = w.detach()
                if b is not None:
                    state[f"{name}.bias"] = b.detach()
        key = "hf.model.language_model.embed_tokens.weight"
        state[key] = fold_rows(state[key], self.row_ids, self.rows)
        state.pop("hf.lm_head.weight", None)
        return {k: v.contiguous().cpu() for k, v in m.release_state_dict(state).items()}

    def save_pretrained(self, path: str | Path) -> Path:
        """A release-format directory (config.json, pytorch_model.bin, tokenizer files): loadable by
        `ReleaseCaptioner.from_release`, the engine, Serve and `infer.parity.check`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        m = self.model
        m.hf_config.save_pretrained(path)
        torch.save(self.merged_release_state(), path / "pytorch_model.bin")
        source = Path(m.source)
        copied = [name for name in TOKENIZER_FILES if source.is_dir() and (source / name).is_file()]
        for name in copied:
            shutil.copy2(source / name, path / name)
        if not copied:
            m.tokenizer.save_pretrained(str(path))
        (path / "padcaptioner_release.json").write_text(json.dumps({"settings": m.describe()}, indent=2))
        return path


def release_tuner(cfg) -> ReleaseFinetune:
    """The fine-tuning model of a run whose model.backbone is a release checkpoint: LoRA r / alpha /
    dropout, caption cut and grounding weight from the model section; positions in `training`
    mode (what the release trained with); the run's `release` section for the rest."""
    mc = cfg.model
    base = ReleaseCaptioner.from_release(mc.backbone, settings_from(cfg, positions="training"))
    return ReleaseFinetune(base, lora_r=mc.lora_r, lora_alpha=mc.lora_alpha, lora_dropout=mc.lora_dropout,
                           max_caption_tokens=mc.max_caption_tokens, grounding_loss_weight=mc.grounding_loss_weight)
