"""padded_over_needed: the query-key pairs FlexAttention would compute over those the step's tokens see.

By arithmetic from every step's own attention metadata (infer/engine/attn_meta.py `flex_work`), in an
arrival run with the engine at a given size (step budget, page size, query block). `bench/throughput.py`
reports it at the engine's CUDA defaults and, at the same budget, with the CPU's pages and query blocks
(what smaller flex tiles would bring).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from infer.engine.attn_meta import flex_work
from infer.engine.core import CaptionEngine, step_defaults
from infer.engine.requests import Request
from pipeline.config import InferConfig


def padding_sizes() -> dict[str, dict[str, int]]:
    """The sizes to weigh, from the engine's own defaults (infer/engine/core.py `step_defaults`).

    >>> sizes = padding_sizes()
    >>> sizes["cuda_defaults"]
    {'step_tokens': 2048, 'page_size': 128, 'q_block': 32}
    >>> sorted(sizes)
    ['cuda_defaults', 'pages_16_q_block_16']
    """
    steps, pages, q_block = step_defaults(InferConfig(), torch.device("cuda"))
    _, cpu_pages, cpu_q_block = step_defaults(InferConfig(), torch.device("cpu"))
    return {"cuda_defaults": {"step_tokens": steps, "page_size": pages, "q_block": q_block},
            f"pages_{cpu_pages}_q_block_{cpu_q_block}": {"step_tokens": steps, "page_size": cpu_pages,
                                                          "q_block": cpu_q_block}}


def padding_runs(model, cfg: InferConfig, videos) -> dict:
    """padded_over_needed at 16 in flight for each of `padding_sizes()`."""
    return {name: padding_run(model, cfg, videos, sizes) for name, sizes in padding_sizes().items()}


def padding_run(model, cfg: InferConfig, videos, sizes: dict[str, int], in_flight: int = 16) -> dict:
    """padded_over_needed of the arrival run at `in_flight` with the engine at `sizes`
    (step_tokens, page_size, q_block): every step's attention metadata as the scheduler builds it,
    weighed as FlexAttention would compute it, the step's main blocks once per layer and a layered
    part's blocks once. Overall, and over the steps without prefill (decode and planning rows only)."""
    eng = CaptionEngine(model, replace(cfg, max_batch_videos=in_flight, cuda_graphs="off",
                                       max_batch_rows=max(cfg.max_events, in_flight * cfg.max_events), **sizes))
    sched, layers, work = eng.scheduler, eng.weights.num_layers, []
    build = sched._meta

    def recording(blocks, seq_a, lim_a, seq_b, lim_b, q_block, workspace=None):
        c, n = flex_work(blocks, lim_a, lim_b, q_block, eng.pool.page_size)
        part = workspace is sched.part_workspace
        work.append((c * (1 if part else layers), n * (1 if part else layers), part))
        return build(blocks, seq_a, lim_a, seq_b, lim_b, q_block, workspace)

    sched._meta = recording
    eng.run(iter([Request(s, c) for s, c in videos]), lambda req, res: None)
    log = eng.stats["step_log"]
    mains = [w for w in work if not w[2]]
    if len(mains) != len(log):
        raise RuntimeError(f"{len(mains)} step metas for {len(log)} steps")
    plain = [not (r.prefill_tokens or r.layer_tokens) for r in log]  # decode / planning rows only
    ratio = lambda ws: round(sum(c for c, _, _ in ws) / max(1, sum(n for _, n, _ in ws)), 3)  # noqa: E731
    return {**sizes, "q_rows_per_block": sched.prefill_block, "steps": len(log), "overall": ratio(work),
            "decode_and_planning_steps": ratio([w for w, p in zip(mains, plain) if p])}
