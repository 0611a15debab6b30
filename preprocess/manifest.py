"""The preprocess manifest: one Parquet row per input video, and the commit protocol.

A preprocess run works in chunks. Each chunk writes its shards into its own
directory `shards/<chunk>/` and then, as its commit marker, a manifest part
`manifest/<chunk>.parquet`. A chunk directory without a part is the debris of
a killed run: it is deleted on the next run and its videos are redone, so a
killed-and-restarted run ends with exactly the samples of an uninterrupted one.
`manifest.parquet` is the consolidation of all parts (latest row per video).

Re-runs. A video is done when its latest ok row has the same feature hash *and* the same
`annotation_hash` (its split, source, duration and events as read): edited captions,
times or splits redo it. A redone video leaves its old sample in an older chunk's shard
(same key, maybe another split's tar), so readers never take whole tars: they take the
manifest's current (shard, key) per video (`current_keys`, `train.data.read_shard_records`).
A video no longer in the annotations loses its row at the next run's consolidation
(`consolidate(keep=...)`): its old sample stays in its tar, but no reader takes it.

Pure python + pyarrow (no ray).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.schema import FIELDS, KEY

COLUMNS: dict[str, pa.DataType] = {
    "video_id": pa.string(),
    "uri": pa.string(),
    "split": pa.string(),
    "source": pa.string(),
    "status": pa.string(),  # ok | error
    "error": pa.string(),
    "shard": pa.string(),
    "key": pa.string(),
    "num_segments": pa.int64(),
    "num_events": pa.int64(),
    "clipped_events": pa.int64(),
    "duration": pa.float64(),
    "feature_hash": pa.string(),
    "annotation_hash": pa.string(),  # what the sample was built from (annotation_hash()); None in old manifests
    "seconds": pa.float64(),
    "chunk": pa.string(),
}


DUPLICATE_ID_ERROR = "annotation: duplicate video id (first record kept)"


def annotation_hash(split: str, source: str, duration: float, events: list[dict[str, Any]]) -> str:
    """Hash of one video's annotation as preprocessing uses it (events as dicts, in order)."""
    blob = json.dumps({"split": split, "source": source, "duration": float(duration), "events": events},
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def empty_row(**values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in COLUMNS}
    row.update(values)
    return row


def write_table(path: str, rows: list[dict[str, Any]]) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=pa.schema(COLUMNS)), buf)
    storage.write_bytes(path, buf.getvalue())


def read_table(path: str) -> list[dict[str, Any]]:
    return pq.read_table(io.BytesIO(storage.read_bytes(path))).to_pylist()


def manifest_dir(out_dir: str) -> str:
    return storage.join(out_dir, "manifest")


def shards_dir(out_dir: str) -> str:
    return storage.join(out_dir, "shards")


def manifest_path(out_dir: str) -> str:
    return storage.join(out_dir, "manifest.parquet")


def committed_parts(out_dir: str) -> dict[str, list[dict[str, Any]]]:
    """{chunk name: rows} of every committed chunk, in commit order."""
    parts = storage.list_files(manifest_dir(out_dir), (".parquet",))
    return {p.rsplit("/", 1)[-1][: -len(".parquet")]: read_table(p) for p in parts}


def remove_uncommitted(out_dir: str, committed: set[str]) -> list[str]:
    """Delete shard directories of chunks that never wrote their manifest part."""
    fs, inner = storage.filesystem(shards_dir(out_dir))
    if not fs.exists(inner):
        return []
    removed = []
    for entry in fs.ls(inner, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name not in committed:
            fs.rm(entry, recursive=True)
            removed.append(name)
    return removed


def consolidate(out_dir: str, keep: set[str] | None = None) -> list[dict[str, Any]]:
    """Merge the parts (later chunks win per video), write manifest.parquet, return rows.
    `keep`: the video ids of the current annotations; the rows of any other video are left out."""
    latest: dict[str, dict[str, Any]] = {}
    for rows in committed_parts(out_dir).values():
        for row in rows:
            if keep is not None and row["video_id"] not in keep:
                continue  # removed from the annotations
            prev = latest.get(row["video_id"])
            if prev is not None and prev["status"] == "ok" and row["error"] == DUPLICATE_ID_ERROR:
                continue  # an ok sample is never replaced by a later record repeating its id
            # any other later row wins, a failure too: the video was redone (its annotation
            # changed) and the old sample no longer matches it
            latest[row["video_id"]] = row
    rows = sorted(latest.values(), key=lambda r: (r["split"] or "", r["video_id"]))
    write_table(manifest_path(out_dir), rows)
    return rows


def write_shard(path: str, records: list[dict[str, Any]]) -> None:
    """One uncompressed WebDataset tar (local or remote) of `records` (KEY + the schema's FIELDS,
    bytes each), members `<key>.<field>` in record order: what the readers of this module and
    train.data stream. Written in one pass (stream mode), so an s3:// object appears whole or not
    at all; a local file cut short by a kill sits in an uncommitted chunk and is deleted with it."""
    storage.makedirs(path.rsplit("/", 1)[0])
    fs, inner = storage.filesystem(path)
    with fs.open(inner, "wb") as f, tarfile.open(fileobj=f, mode="w|") as tar:
        for rec in records:
            for field in FIELDS:
                data = rec[field]
                info = tarfile.TarInfo(f"{rec[KEY]}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_chunk_shards(out_dir: str, chunk: str, records: list[tuple[str, dict[str, Any]]],
                       target_bytes: int) -> dict[str, str]:
    """Write one chunk's samples as tars under `shards/<chunk>/<split>/` -> {key: shard path}.

    records: (split, encoded sample) pairs in the chunk's order. Each split's tars are filled in
    order up to `target_bytes` of sample data (a sample larger than that gets a tar of its own);
    names are `00000.tar`, `00001.tar`, ... so a retried chunk overwrites its own files."""
    where: dict[str, str] = {}
    for split in sorted({s for s, _ in records}):
        base = storage.join(shards_dir(out_dir), chunk, split)
        tars: list[list[dict[str, Any]]] = [[]]
        size = 0
        for rec in [r for s, r in records if s == split]:
            n = sum(len(rec[f]) for f in FIELDS)
            if tars[-1] and size + n > target_bytes:
                tars.append([])
                size = 0
            tars[-1].append(rec)
            size += n
        for index, batch in enumerate(tars):
            path = storage.join(base, f"{index:05d}.tar")
            write_shard(path, batch)
            where.update((rec[KEY], path) for rec in batch)
    return where


def iter_shard(shard_path: str):
    """The WebDataset field dicts of one tar (local or remote), in file order."""
    fs, inner = storage.filesystem(shard_path)
    groups: dict[str, dict[str, Any]] = {}
    with fs.open(inner, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, field = member.name.split(".", 1)
            groups.setdefault(key, {KEY: key})[field] = tar.extractfile(member).read()
    yield from groups.values()


def removed_videos(parts: dict[str, list[dict[str, Any]]], keep: set[str]) -> list[str]:
    """Sorted ids that have rows in `parts` but are not in `keep` (the current annotations)."""
    return sorted({row["video_id"] for rows in parts.values() for row in rows} - keep)


def done_videos(parts: dict[str, list[dict[str, Any]]], feature_hash: str) -> dict[str, str]:
    """{video id: annotation hash} of the videos whose latest row (in commit order) is ok with
    `feature_hash`; the rows of other records repeating an id do not count."""
    latest: dict[str, dict[str, Any]] = {}
    for rows in parts.values():
        for row in rows:
            if row["error"] != DUPLICATE_ID_ERROR:
                latest[row["video_id"]] = row
    return {vid: r.get("annotation_hash") or "" for vid, r in latest.items()
            if r["status"] == "ok" and r["feature_hash"] == feature_hash}


def current_keys(rows: list[dict[str, Any]], split: str | None = None) -> dict[str, list[str]]:
    """{shard: sorted sample keys} of the manifest's ok rows (of one split): the only records
    a reader may take from those shards (older samples of redone videos share them)."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "ok" and (split is None or r["split"] == split):
            out.setdefault(r["shard"], []).append(r["key"])
    return {shard: sorted(keys) for shard, keys in sorted(out.items())}


def ok_shards(rows: list[dict[str, Any]], split: str | None = None) -> list[str]:
    """The shard files holding the ok samples (of one split), sorted."""
    return list(current_keys(rows, split))

