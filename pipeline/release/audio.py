"""The release's audio tower: Whisper encoder + a window Q-Former -> LLM-width audio tokens.

    audio = ReleaseAudio(audio_config, llm_width)          # audio_config: the checkpoint's dict
    tokens = audio(mel)                                    # mel [C, 128, 3000] -> [C, 60, d]

Each 30 s chunk goes through the Whisper encoder alone ([1500, dw] after its final
LayerNorm); the frames are cut into windows of `round(1500 * second_per_window / 30)`
frames (25 for 0.5 s) with the same stride, one learnt query per window cross-attends
to its window through a BERT-style Q-Former (self-attention, cross-attention to the
window, a query-only feed-forward: the layer has no text branch), and `audio_proj`
takes the query's output to the LLM width: 60 tokens per chunk, 2 per second, token j
covering [0.5 j, 0.5 (j + 1)) s of the audio stream (docs/design/release.md 4.2).

Module names follow the release's keys under `audio.` (`qformer.bert.encoder.layer.N.
crossattention.self.key`, ...) so the checkpoint maps onto it one to one; the Whisper
encoder is HF's `WhisperEncoder`. Dimensions come from the checkpoint's nested
`qformer_config`, never assumed. Pure torch + HF.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import WhisperConfig
from transformers.activations import ACT2FN
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from pipeline.release.geometry import CHUNK_SECONDS


class _Heads(nn.Module):
    """BERT multi-head attention projections (`self.query/key/value`); no dropout at inference."""

    def __init__(self, dim: int, heads: int, kv_dim: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(kv_dim, dim)
        self.value = nn.Linear(kv_dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x [B, n, dim], context [B, m, kv_dim] -> [B, n, dim]."""
        b, n, dim = x.shape
        hd = dim // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, hd).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(context)), split(self.value(context))
        probs = (q @ k.transpose(-1, -2) / math.sqrt(hd)).softmax(dim=-1)
        return (probs @ v).transpose(1, 2).reshape(b, n, dim)


class _Residual(nn.Module):
    """dense -> + input -> LayerNorm (BERT's `*Output` block)."""

    def __init__(self, in_dim: int, dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_dim: int, eps: float):
        super().__init__()
        self.self = _Heads(dim, heads, kv_dim)
        self.output = _Residual(dim, dim, eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, context), x)


class QFormerLayer(nn.Module):
    """Query self-attention -> cross-attention to the window -> query feed-forward."""

    def __init__(self, q: dict, cross: bool):
        super().__init__()
        dim, heads, eps = q["hidden_size"], q["num_attention_heads"], q.get("layer_norm_eps", 1e-12)
        self.attention = _Attention(dim, heads, dim, eps)
        self.crossattention = _Attention(dim, heads, q["encoder_width"], eps) if cross else None
        self.intermediate_query = nn.Module()  # a plain container: the release's key name of `dense`
        self.intermediate_query.dense = nn.Linear(dim, q["intermediate_size"])
        self.act = ACT2FN[q.get("hidden_act", "gelu")]
        self.output_query = _Residual(q["intermediate_size"], dim, eps)

    def forward(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x)
        if self.crossattention is not None:
            x = self.crossattention(x, window)
        return self.output_query(self.act(self.intermediate_query.dense(x)), x)


class WindowQFormer(nn.Module):
    """queries [B, n, Hq] x windows [B, w, dw] -> [B, n, Hq] (`qformer.bert.*` of the release).

    `bert.embeddings` and `bert.encoder` are plain containers: they only give the release's key names."""

    def __init__(self, q: dict):
        super().__init__()
        every = int(q.get("cross_attention_freq", 1))
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        self.bert.embeddings.LayerNorm = nn.LayerNorm(q["hidden_size"], eps=q.get("layer_norm_eps", 1e-12))
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList(QFormerLayer(q, cross=i % every == 0) for i in range(q["num_hidden_layers"]))

    def forward(self, queries: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        x = self.bert.embeddings.LayerNorm(queries)
        for layer in self.bert.encoder.layer:
            x = layer(x, windows)
        return x


class ReleaseAudio(nn.Module):
    """Whisper encoder + window Q-Former + audio_proj (module doc)."""

    def __init__(self, audio_config: dict, llm_width: int):
        super().__init__()
        cfg = dict(audio_config)
        q = dict(cfg.pop("qformer_config"))
        self.second_per_window = float(cfg.pop("second_per_window", 0.5))
        self.second_stride = float(cfg.pop("second_stride", self.second_per_window))
        if self.second_stride != self.second_per_window:
            raise ValueError(f"audio windows with a stride ({self.second_stride}) other than their length "
                             f"({self.second_per_window}) are not supported")
        self.whisper = WhisperEncoder(WhisperConfig(**cfg))
        self.frames = int(self.whisper.config.max_source_positions)  # encoder frames per 30 s chunk
        self.window = round(self.frames * self.second_per_window / CHUNK_SECONDS)
        self.q_tokens = nn.Parameter(torch.zeros(1, int(q.get("query_length", 1)), q["hidden_size"]))
        self.qformer = WindowQFormer(q)
        self.audio_proj = nn.Linear(q["hidden_size"], llm_width)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [C, n_mels, 3000] -> Whisper states [C, 1500, dw] (each chunk alone)."""
        w = self.whisper
        return w(mel.to(w.conv1.weight.dtype)).last_hidden_state

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [C, n_mels, 3000] -> audio tokens [C, frames // window * queries, d]."""
        states = self.encode(mel)
        c, f, dw = states.shape
        n = f // self.window
        windows = states[:, : n * self.window].reshape(c * n, self.window, dw)
        queries = self.q_tokens.to(windows.dtype).expand(c * n, -1, -1)
        out = self.qformer(queries, windows)  # [C*n, q, Hq]
        return self.audio_proj(out).reshape(c, n * out.shape[1], -1)
