"""Peak object-store use of reading the training set: one pass (train/trainer.read_train_dataset)
against the former sort + repartition, two full materialisations, measured side by side.

    flock /tmp/ray.lock .venv/bin/python -m bench.train_read [--samples 96] [--mb 4]

Writes `--samples` records of `--mb` MB of random bytes each into 3 tars (keys in another
order than the sort), runs both readers on one local Ray instance (2 CPUs, 1.5 GB object
store), samples the object store's used bytes every 50 ms while each runs, and prints the
peaks (and what each holds once done: the materialised set) and whether both gave the same
rows in the same order.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import webdataset as wds

from pipeline.schema import FIELDS, KEY

ROOT = Path(__file__).resolve().parents[1]


def plasma_used_mb() -> float:
    from ray._private.internal_api import memory_summary

    m = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
    return float(m.group(1)) if m else 0.0


def peak_while(fn) -> tuple[float, object]:
    """(peak object-store MiB while `fn()` runs, its result)."""
    peak, done = [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], plasma_used_mb())
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
        peak[0] = max(peak[0], plasma_used_mb())
    finally:
        done.set()
        t.join()
    return peak[0], out


def two_pass(keys: dict[str, list[str]]):
    """The reader before this change: read_webdataset, filter, sort, materialise, repartition, materialise."""
    import ray

    from train.trainer import ROWS_PER_BLOCK

    wanted = {(p, k) for p, ks in keys.items() for k in ks}
    ds = ray.data.read_webdataset(list(keys), decoder=None, include_paths=True, num_cpus=0.25)
    ds = ds.filter(lambda r: (r["path"], r[KEY]) in wanted).drop_columns(["path"])
    ds = ds.sort(KEY).materialize()
    return ds.repartition(max(1, -(-ds.count() // ROWS_PER_BLOCK)), shuffle=False).materialize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--mb", type=float, default=4.0)
    args = ap.parse_args(argv)
    import ray

    from train.trainer import read_train_dataset

    work = Path(tempfile.mkdtemp(prefix="padcap-bench-read-"))
    rng = np.random.default_rng(0)
    ids = [f"v{i:05d}" for i in range(args.samples)]
    order = ids[:]
    random.Random(0).shuffle(order)
    keys: dict[str, list[str]] = {}
    per_field = int(args.mb * 1e6 / len(FIELDS))
    for g in range(3):
        path = str(work / f"part-{g}.tar")
        with wds.TarWriter(path) as sink:
            for vid in order[g::3]:
                sink.write({KEY: vid, **{f: rng.bytes(per_field) for f in FIELDS}})
        keys[path] = sorted(order[g::3])
    ray.init(address="local", num_cpus=2, object_store_memory=1_500_000_000, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        results, orders = {}, {}
        for name, fn in (("one_pass", lambda: read_train_dataset(keys)), ("two_pass", lambda: two_pass(keys))):
            before = plasma_used_mb()
            peak, ds = peak_while(fn)
            rows = orders[name] = [r[KEY] for r in ds.iter_rows()]
            results[name] = {"object_store_before_mib": before, "peak_object_store_mib": peak,
                             "held_after_mib": plasma_used_mb(), "rows": len(rows), "sorted": rows == sorted(rows),
                             "blocks": ds.num_blocks()}
            del ds
            deadline = time.monotonic() + 30  # the next reader starts from an empty store
            while plasma_used_mb() > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
        data_mib = args.samples * per_field * len(FIELDS) / 2**20
        same = orders["one_pass"] == orders["two_pass"]
        print(json.dumps({"data_mib": round(data_mib, 1), **results, "same_rows_in_the_same_order": same}, indent=1))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
