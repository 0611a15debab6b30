"""padded_over_needed: the query-key pairs FlexAttention would compute over those the step's tokens see.

By arithmetic from every step's own attention metadata (infer/engine/attn_meta.py `flex_work`), in an
arrival run with the engine at a given size (step budget, page size, query block). `bench/throughput.py`
reports it at the engine's CUDA defaults and, at the same budget, with the CPU's pages and query blocks
(what smaller flex tiles would bring).

Besides what the engine builds (`overall`), each run weighs the same steps' blocks as two designs
not built yet would lay them out (`projected`, by the same arithmetic, `split_work`): the blocks of at
most `q_block` rows (branch and planning rows, a prefill chunk's short tail) in a second BlockMask whose
query block fits them (`small_blocks`: a power of two, 16 to 128), and the same with a KV group's query
heads folded into those rows (`small_blocks_gqa_folded`: one program per KV head computes the rows of its
g query heads at once). Keys stay as built (pages read whole), so neither projection removes the
siblings' branch pages every branch row scans.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from infer.engine.attn_meta import flex_work, pow2
from infer.engine.core import CaptionEngine, step_defaults
from infer.engine.packing import QueryBlock
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


def split_work(blocks: list[QueryBlock], needed: int, *, small: int, big: int, page_size: int,
               group: int = 1, fold: bool = False) -> tuple[float, int]:
    """(computed, needed) query-key pairs per query head of one step's blocks laid out in two BlockMasks:
    blocks of more than `small` rows in one of `big` rows, the rest in one whose query block is the
    smallest power of two (at least 16, at most `big`) that holds the largest of them; fold: each of
    those rows counted `group` times (a KV head's query heads folded into the rows) and computed once per
    KV head. Every listed page read whole, as `flex_work` does.

    The block of `flex_work`'s example (3 branch rows, 6 pages of 16) in a 16-row block, then with 4
    query heads folded (12 rows: still one 16-row block, now for 4 heads):

    >>> split_work([QueryBlock(range(3), [0, 1, 2, 7, 8, 9])], 126, small=32, big=128, page_size=16)
    (1536.0, 126)
    >>> split_work([QueryBlock(range(3), [0, 1, 2, 7, 8, 9])], 126, small=32, big=128, page_size=16, group=4, fold=True)
    (384.0, 126)
    """
    real = [b for b in blocks if len(b.tokens)]
    rows = lambda b: len(b.tokens) * (group if fold else 1)  # noqa: E731
    little = [b for b in real if len(b.tokens) <= small]
    bm = min(big, max(16, pow2(max((rows(b) for b in little), default=1))))
    computed = sum(big * len(b.pages) * page_size for b in real if len(b.tokens) > small)
    per_head = group if fold else 1
    computed += sum(-(-rows(b) // bm) * bm * len(b.pages) * page_size / per_head for b in little)
    return float(computed), needed


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
    build, S, group = sched._meta, eng.pool.page_size, eng.weights.heads // eng.weights.kv_heads
    projected = {"small_blocks": [], "small_blocks_gqa_folded": []}

    def recording(blocks, seq_a, lim_a, seq_b, lim_b, q_block, workspace=None):
        part = workspace is sched.part_workspace
        times = 1 if part else layers
        c, n = flex_work(blocks, lim_a, lim_b, q_block, S)
        work.append((c * times, n * times, part))
        for name, fold in (("small_blocks", False), ("small_blocks_gqa_folded", True)):
            pc, pn = split_work(list(blocks), n, small=sched.q_block, big=q_block, page_size=S, group=group, fold=fold)
            projected[name].append((pc * times, pn * times, part))
        return build(blocks, seq_a, lim_a, seq_b, lim_b, q_block, workspace)

    sched._meta = recording
    eng.run(iter([Request(s, c) for s, c in videos]), lambda req, res: None)
    log = eng.stats["step_log"]
    mains = [w for w in work if not w[2]]
    if len(mains) != len(log):
        raise RuntimeError(f"{len(mains)} step metas for {len(log)} steps")
    plain = [not (r.prefill_tokens or r.layer_tokens) for r in log]  # decode / planning rows only
    ratio = lambda ws: round(sum(c for c, _, _ in ws) / max(1, sum(n for _, n, _ in ws)), 3)  # noqa: E731
    both = lambda ws: {"overall": ratio(ws),  # noqa: E731
                       "decode_and_planning_steps": ratio([w for w, p in zip([w for w in ws if not w[2]], plain) if p])}
    return {**sizes, "q_rows_per_block": sched.prefill_block, "query_heads_per_kv_head": group, "steps": len(log),
            **both(work), "projected": {name: both(ws) for name, ws in projected.items()}}
