"""Faults in a Ray Train run, for the kill-restart tests: step hooks for train/trainer.py's `on_step`.

    run_train(cfg, shards, out, on_step=CrashAt(step=3, marker=tmp / "crashed.txt", rank=1))
    run_train(cfg, shards, out, on_step=PauseAt(step=3, marker=tmp / "paused.txt", seconds=90))

Each is a picklable dataclass (Ray Train ships it to the workers with the loop's config), called by
every rank after each optimizer step with its context (train/trainer.py RayContext) and the step.
CrashAt: rank `rank` (default 1 with several workers, else 0) exits the process (`os._exit(1)`, no
clean-up, as a crash) at step `step`, once: while the marker file does not exist (it writes it first).
PauseAt: every rank sleeps `seconds` at step `step`, unless the marker exists (rank 0 writes it: a
restarted run does not pause again): the window in which a node-loss test kills a node.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

CRASH_WAIT_S = 120.0  # the most a crashing rank waits for the controller to hold its last checkpoint


def wait_until_registered(name: str | None, poll_s: float = 0.05) -> None:
    """Block until the Ray Train controller's checkpoint-manager snapshot (written when it registers a
    checkpoint) names checkpoint `name`, or CRASH_WAIT_S passed (then say so)."""
    if name is None:
        return
    import ray.train

    storage = ray.train.get_context().get_storage()
    fs, path = storage.storage_filesystem, storage.checkpoint_manager_snapshot_path
    deadline = time.monotonic() + CRASH_WAIT_S
    while time.monotonic() < deadline:
        try:
            with fs.open_input_stream(path) as f:
                latest = json.loads(f.read().decode()).get("latest_checkpoint_result") or {}
            if latest.get("checkpoint_dir_name") == name:
                return
        except (FileNotFoundError, OSError, ValueError):
            pass  # not written yet, or caught mid-write
        time.sleep(poll_s)
    print(f"[train] fault injection: {name} not registered after {CRASH_WAIT_S:.0f}s; exiting anyway", flush=True)


@dataclass(frozen=True)
class CrashAt:
    """One rank exits at one step, once (module doc)."""

    step: int
    marker: str | Path
    rank: int | None = None

    def __call__(self, ctx, step: int) -> None:
        rank = self.rank if self.rank is not None else (1 if ctx.world_size > 1 else 0)
        if step != self.step or ctx.rank != rank or os.path.exists(self.marker):
            return
        Path(self.marker).write_text(f"rank {ctx.rank} exited at step {step}\n")
        print(f"[train] fault injection: rank {ctx.rank} exits at step {step}", flush=True)
        # The Ray Train controller collects reported checkpoints by polling the workers; a
        # worker that dies within a poll of its last report can take that checkpoint with it
        # (seen once in CI: the restart began at step 0). Exit once the controller holds it, as
        # a real crash long after its last checkpoint would find it.
        wait_until_registered(ctx.last_checkpoint)
        os._exit(1)


@dataclass(frozen=True)
class PauseAt:
    """Every rank pauses at one step, once (module doc)."""

    step: int
    marker: str | Path
    seconds: float = 60.0

    def __call__(self, ctx, step: int) -> None:
        if step != self.step or os.path.exists(self.marker):
            return
        print(f"[train] fault injection: rank {ctx.rank} pauses {self.seconds:.0f}s at step {step}", flush=True)
        if ctx.rank == 0:
            Path(self.marker).write_text(f"paused at step {step}\n")
        time.sleep(self.seconds)
