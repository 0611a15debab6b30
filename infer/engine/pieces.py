"""Piecewise CUDA graphs: a step's work but attention, recorded per token bucket; attention runs eagerly between.

    pieces = StepPieces(runner, tokens=(8, 16, ..., 4096), capture=True)
    hidden, states = pieces.forward(batch, nb)       # nb = pieces.bucket(batch's tokens), else run eagerly

Why. The whole-step graphs (infer/engine/graphs.py) need a step's attention metadata in static
buffers, so they hold decode-only steps; with videos arriving nearly every step is mixed
(prefill chunks, planning rows, layered blocks) and would run its ~27 kernels x 36 layers one
launch at a time. Everything in a layer but attention is row-wise in the step's tokens (norms,
projections, rotation, the KV write, the MLP): it depends on the token count only, so it is
recorded once per token bucket N_b and replayed for any mix of tokens. Per bucket, L + 1 pieces
over static buffers x [N_b, d], cos / sin [N_b, 1, D], slots [N_b], q [N_b, Hq, D], o [N_b, Hq*D]:

    piece 0:      q = qkv(layer 0; x, cos, sin, slots)
    piece i:      x = out_and_mlp(layer i-1; x, o); q = qkv(layer i)        (0 < i < L)
    piece L:      x = out_and_mlp(layer L-1; x, o); hidden = norm(x)
    between i, i+1 (eager): o[:n] = attend(layer i; q[:n], the step's AttnMeta, its layered parts)

So the attention kernel (any kernel) reads the step's own metadata, and a layered block's parts
(infer/engine/step.py LayerJob) run eagerly in the same window. Padding rows (n to N_b) write
their KV to the scratch page (slot 0, which nothing real reads) and their outputs are dropped;
each row's arithmetic is its own (tests/test_graphs.py checks a replayed step == the eager one on
the CPU, `capture=False`: the same buffers and pieces, run eagerly). The buffers are those of
the largest bucket; a smaller bucket records over their leading rows. Every bucket's pieces share
one memory pool and one capture stream; a piece keeps nothing in the pool after it runs (its
outputs go to the static buffers), so any order of replays is safe. Pure torch; no ray.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.engine.step import ForwardBatch, ModelRunner


class StepPieces:
    """The step's non-attention pieces per token bucket (module doc). tokens: the buckets, ascending;
    capture: record CUDA graphs now (else the pieces run eagerly over the same buffers: the CPU stand-in)."""

    def __init__(self, runner: ModelRunner, tokens: tuple[int, ...], capture: bool):
        self.runner, self.tokens = runner, tuple(sorted(tokens))
        w, dev = runner.w, runner.pool.device
        n = self.tokens[-1]
        self.x = torch.zeros(n, w.hidden, dtype=w.dtype, device=dev)
        self.hidden = torch.zeros_like(self.x)
        self.cos = torch.zeros(n, 1, w.head_dim, dtype=w.dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.q = torch.zeros(n, w.heads, w.head_dim, dtype=w.dtype, device=dev)
        self.o = torch.zeros(n, w.heads * w.head_dim, dtype=w.dtype, device=dev)
        self.graphs: dict[int, list] = {}  # bucket -> its L + 1 recorded pieces
        if capture:
            self._capture_all()

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket of at least `tokens`, or None (the step runs eagerly)."""
        return next((t for t in self.tokens if t >= tokens), None)

    def piece(self, i: int, nb: int) -> None:
        """Piece i of bucket nb over the static buffers' first nb rows (module doc)."""
        r, layers = self.runner, self.runner.w.layers
        x = self.x[:nb]
        if i > 0:
            x.copy_(r.out_and_mlp(layers[i - 1], x, self.o[:nb]))
        if i < len(layers):
            self.q[:nb].copy_(r.qkv(layers[i], i, x, self.cos[:nb], self.sin[:nb], self.slots[:nb]))
        else:
            self.hidden[:nb].copy_(r.w.norm(x))

    def _run(self, i: int, nb: int) -> None:
        if nb in self.graphs:
            self.graphs[nb][i].replay()
        else:
            self.piece(i, nb)

    def forward(self, batch: ForwardBatch, nb: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """ModelRunner.forward's outputs for a step of at most nb tokens, through bucket nb's pieces."""
        r, n = self.runner, batch.embeds.shape[0]
        layers = len(r.w.layers)
        self.x[:n].copy_(batch.embeds)
        self.x[n:nb].zero_()
        self.slots[:n].copy_(batch.slots)
        self.slots[n:nb].zero_()  # the scratch page's first slot
        cos, sin = r.rope(batch.positions, batch.embeds.dtype)
        self.cos[:n].copy_(cos)
        self.sin[:n].copy_(sin)
        states = {0: batch.embeds} if 0 in batch.capture else {}
        at = r.parts_by_layer(batch)
        self._run(0, nb)
        for li in range(layers):
            self.o[:n].copy_(r.attend(li, self.q[:n], batch.attn, at.get(li, ())))
            self._run(li + 1, nb)
            if li + 1 in batch.capture:
                states[li + 1] = (self.hidden if li + 1 == layers else self.x)[:n].clone()
        return self.hidden[:n].clone(), states

    @torch.no_grad()
    def _capture_all(self) -> None:
        """Every bucket's pieces, largest first, into one pool on one stream (torch.cuda.graph's rule for
        sharing a pool). Raises on a failure (the caller runs eagerly and says why)."""
        pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.x.zero_()
        self.slots.zero_()
        for nb in reversed(self.tokens):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: the allocator and any lazy init outside a capture
                for i in range(len(self.runner.w.layers) + 1):
                    self.piece(i, nb)
            torch.cuda.current_stream().wait_stream(side)
            self.graphs[nb] = [self._record(pool, side, lambda i=i: self.piece(i, nb))
                               for i in range(len(self.runner.w.layers) + 1)]
        torch.cuda.synchronize()

    @staticmethod
    def _record(pool, stream, fn: Callable[[], None]):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            fn()
        return g

    def drop(self) -> None:
        """Forget the recorded graphs (their pool memory goes back): every bucket then runs its pieces eagerly."""
        self.graphs = {}
