"""CaptionService: one request -> a checked local video -> features -> the engine -> a response.

The plain logic of the serving endpoint (no ray, no HTTP): infer/serving/api.py puts a
FastAPI app in front of it and infer/serving/deployment.py makes it a Ray Serve deployment.
The decoding engine is injected as a factory `InferConfig -> engine`, so tests run
the real tiny model or any object with the engine's serving interface (`Engine` below).

    service = CaptionService(cfg, engine_factory=partial(CaptionEngine, model), card=card)
    # the encoders: preprocess.featurize.Featurizer(cfg), built once per replica
    body = await service.caption_uri("/data/videos/a.mp4", {"max_events": 5})
    body = await service.caption_file(tmp_path, "a.mp4", None)

Per request: resolve the URI against the allow-list (infer/serving/uris.py), copy remote
videos to a capped temp file, probe the container header (PyAV: is there a video
stream, its duration and resolution; over serve.max_duration_s or
serve.max_frame_pixels is refused before decoding), then decode + encode
features (`preprocess.featurize.Featurizer`). All of that runs in a thread pool
under serve.decode_timeout_s, so the event loop stays free; the decode itself runs
in a worker process (infer/serving/media_pool.py) that is killed and replaced when it
passes serve.decode_timeout_s, so a stuck decode never keeps a thread or a worker.
The workers decode media only (`MediaReader`: frames and audio as arrays, at most
serve.max_decoded_bytes); the replica's one Featurizer runs the encoders (the towers:
one copy per replica, on its device) on what they send back, one video at a time (an
in-process `featurizer` passed by a test does both halves in the thread); the engine runs in
its own single thread (one engine call at a time per replica, the model is not
shared between threads), decoding many videos per step: a request that arrives
while others are being decoded joins the running batch at the next decode step,
up to serve.batch_videos in flight (infer/serving/engine_loop.py, continuous batching). Every problem caused by the request is a `RequestError` (4xx);
anything else is a server bug and propagates.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Protocol

from pydantic import ValidationError

from infer.engine.requests import Request, VideoOptions
from infer.loading import ModelCard  # noqa: F401  (re-exported: the card a replica serves)
from infer.serving.bodies import remove_orphaned_spool
from infer.serving.engine_loop import EngineBatcher
from infer.serving.errors import RequestError
from infer.serving.media_pool import BOOT_TIMEOUT_S, DecodePool, DecodeTimeout
from infer.serving.protocol import CaptionOptions, error_message
from infer.serving.uris import UriPolicy, materialize
from pipeline.config import Config, InferConfig, section_hash
from pipeline.schema import Sample
from preprocess.featurize import Featurizer, MediaReader, Unannotated

log = logging.getLogger("padcap.serve")


class Engine(Protocol):
    """What the service needs of an engine, as infer.engine.core.CaptionEngine offers it (test stand-ins
    offer the same: bench/serve_engine.py). infer/serving/engine_loop.py drives it.

    run(feed, emit): decode every request `feed` gives (polled at each step boundary; None: nothing now),
        `emit(request, decoded)` as each finishes; returns when nothing is in flight and `feed` has nothing.
    result(sample, decoded): what `emit` handed over -> the VideoResult a response is made of."""

    def run(self, feed: Callable[[], Request | None], emit: Callable[[Request, Any], None]) -> None: ...

    def result(self, sample: Sample, decoded: Any) -> Any: ...


@dataclass
class VideoProbe:
    duration: float | None
    width: int
    height: int


def probe_video(path: str, name: str) -> VideoProbe:
    """Read only the container header (PyAV): a video stream must exist; duration and size."""
    import av

    try:
        with av.open(path, metadata_errors="ignore") as container:
            if not container.streams.video:
                raise RequestError(422, "no_video", f"{name!r} has no video stream")
            v = container.streams.video[0]
            duration = None
            if v.duration is not None and v.time_base:
                duration = float(v.duration * v.time_base)
            elif container.duration is not None:
                duration = container.duration / 1_000_000
            return VideoProbe(duration, int(v.codec_context.width or 0), int(v.codec_context.height or 0))
    except RequestError:
        raise
    except Exception as e:  # av.error.InvalidDataError and friends: not a container we can read
        raise RequestError(422, "not_a_video", f"{name!r} is not a readable video file ({e.__class__.__name__})") from None


def safe_video_id(name: str, fallback: str = "video") -> str:
    stem = PurePosixPath(name).stem if name else ""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._")[:100]
    return clean or fallback


def _media_error(e: Exception, path: str, name: str) -> RequestError:
    """A decode failure as a 422 (413 for size), with the server's paths replaced by the client's name."""
    kind = getattr(e, "kind", None)
    text = (getattr(e, "reason", None) or str(e) or e.__class__.__name__).replace(path, name)
    text = text.splitlines()[0][:400] if text else e.__class__.__name__
    if kind == "too_large":
        return RequestError(413, "too_large", text)
    if kind == "empty":
        return RequestError(400, "empty_file", text)
    if kind is None:  # a DecodeFailure from a worker names the class raised there
        cls = getattr(e, "error_type", e.__class__.__name__)
        return RequestError(422, "undecodable", f"{name!r} could not be decoded as a video ({cls}: {text})")
    return RequestError(422, kind, text)


class CaptionService:
    """Decode request -> features -> engine -> response dict. One per replica."""

    def __init__(self, cfg: Config, engine_factory: Callable[[InferConfig], Engine], card: ModelCard,
                 featurizer: Callable[[str, Any], Sample] | None = None,
                 featurizer_factory: Callable[[Config], Any] = Featurizer,
                 reader_factory: Callable[[Config], Callable[[str, Any], Any]] = MediaReader, warm: bool = False):
        """featurizer: an in-process featurizer (decodes and encodes in the decode thread, cannot be
        stopped); without one, `reader_factory(cfg)` (module-level, picklable) builds the decoder inside
        each decode worker process and `featurizer_factory(cfg)` the replica's encoders, once: its
        `encode(media, annotation)` runs on what the workers send back. warm (a Serve replica): start the
        decode workers first, so that they boot while the encoders load, and return only once they are
        ready and the engine is built: Serve sends requests to a replica as soon as its constructor
        returns, and a replica started in place of a lost one would otherwise make its first requests
        wait for its workers' boot (tens of seconds on a busy machine)."""
        self.cfg = cfg
        self.serve_cfg = cfg.serve
        self.card = card
        self._engine_factory = engine_factory
        removed = remove_orphaned_spool(cfg.serve.upload_dir or None)  # a killed replica's uploads cannot clean up after themselves
        if removed:
            log.info("removed %d temp files left by replicas no longer alive", removed)
        self.policy = UriPolicy(cfg.serve.allowed_roots, cfg.serve.allowed_http_hosts, cfg.data.video_extensions)
        workers = cfg.serve.decode_workers or max(1, cfg.serve.max_ongoing_requests)
        self._decode_pool = ThreadPoolExecutor(workers, thread_name_prefix="padcap-decode")
        self.decoders: DecodePool | None = None
        self.encoders = None  # the replica's Featurizer (its encode half), with decode workers
        self._encode_lock = threading.Lock()  # one video through the towers at a time: bounded memory
        if featurizer is not None:
            self._featurize = featurizer
        else:
            self.decoders = DecodePool(workers, reader_factory, cfg, cfg.serve.max_decoded_bytes)
            if warm:
                self.decoders.warm()
            self.encoders = featurizer_factory(cfg)
            self._featurize = self._featurize_in_worker
        self._batcher = EngineBatcher(cfg.serve.batch_videos or max(1, cfg.infer.max_batch_videos))
        self._engine: Engine | None = None
        self.engine_builds = 0  # engines this replica built (1 once warm; /healthz says it)
        self.counters = collections.Counter()
        self.in_flight = 0  # requests inside _caption now (decoding or in the engine)
        self.config_hash = section_hash({"model": dataclasses.asdict(cfg.model), "features": dataclasses.asdict(cfg.features)})
        if warm:
            if self.decoders is not None:
                self.decoders.warm(wait=True)
            self.engine()
        self.engine_built_at_start = self._engine is not None  # a Serve replica's: ready only once built

    # ------------------------------------------------------------------ options

    def check_options(self, options: CaptionOptions | dict | None) -> CaptionOptions:
        """Validate options (unknown names, types, bounds, the server's caps) -> 422 naming the option."""
        if options is None:
            return CaptionOptions()
        if not isinstance(options, CaptionOptions):
            if not isinstance(options, dict):
                raise RequestError(422, "bad_options", f"options must be a JSON object, got {type(options).__name__}")
            try:
                options = CaptionOptions.model_validate(options)
            except ValidationError as e:
                raise RequestError(422, "bad_options", error_message(e, "options")) from None
        limits = self.engine().cfg  # the engine's settings, with the model's own caps resolved
        caps = {"max_events": limits.max_events, "max_branch_tokens": limits.max_branch_tokens}
        for name, cap in caps.items():
            value = getattr(options, name)
            if value is not None and value > cap:
                raise RequestError(422, "bad_options", f"options.{name}: {value} is over this server's limit of {cap} (infer.{name})")
        return options

    def engine(self) -> Engine:
        """The replica's one engine (built on first use from infer.*): requests with any decoding
        options share it and its decode steps; each request's options travel with it."""
        if self._engine is None:
            self._engine = self._engine_factory(self.cfg.infer)
            self.engine_builds += 1
        return self._engine

    # ------------------------------------------------------------------ requests

    async def caption_uri(self, video: str, options: CaptionOptions | dict | None = None) -> dict[str, Any]:
        """Caption a video named by URI (checked against serve.allowed_roots / allowed_http_hosts)."""
        opts = self.check_options(options)
        return await self._caption(lambda: self._prepare_uri(video), opts)

    async def caption_file(self, path: str, filename: str, options: CaptionOptions | dict | None = None) -> dict[str, Any]:
        """Caption an uploaded video already in a server-side temp file (the caller deletes it)."""
        opts = self.check_options(options)
        return await self._caption(lambda: self._prepare_local(path, filename or "upload", {}), opts)

    async def _caption(self, prepare: Callable[[], tuple[Sample, dict[str, float]]], opts: CaptionOptions) -> dict[str, Any]:
        self.in_flight += 1
        try:
            t0 = time.perf_counter()
            sample, timings = await self._prepared(prepare)
            t1 = time.perf_counter()
            result = await self._batcher.submit("engine", self.engine(), sample, VideoOptions(**opts.overrides()))
            timings["decode_s"] = time.perf_counter() - t1
            error = getattr(result, "error", None)
            if error:  # the engine refused this video (too many segments, too long a sequence, ...)
                self.counters["rejected"] += 1
                raise RequestError(422, "does_not_fit_model", f"the model cannot caption this video: {error}")
            for key, value in (getattr(result, "timings", None) or {}).items():
                timings.setdefault(f"engine_{key}" if not key.startswith("engine") else key, float(value))
            timings["total_s"] = time.perf_counter() - t0
            self.counters["served"] += 1
            return {
                "video_id": sample.video_id,
                "duration": float(result.duration),
                "events": [{"start": float(e.start), "end": float(e.end), "caption": str(e.caption), "capped": bool(c)}
                           for e, c in zip(result.events, getattr(result, "capped", None) or [False] * len(result.events))],
                "segments_kept": int(getattr(result, "segments_kept", 0)),
                "segments_total": int(getattr(result, "segments_total", 0)),
                "timings": {k: round(v, 6) for k, v in timings.items()},
                "model": self.card.model_id,
            }
        finally:
            self.in_flight -= 1

    async def _prepared(self, prepare: Callable[[], tuple[Sample, dict[str, float]]]) -> tuple[Sample, dict[str, float]]:
        """`prepare()` in the decode thread pool, within `_outer_timeout`; a refused video counts as rejected."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._decode_pool, prepare), self._outer_timeout())
        except TimeoutError:
            self.counters["rejected"] += 1
            raise RequestError(422, "decode_timeout", f"reading and decoding the video took longer than "
                               f"{self._outer_timeout()} s (serve.decode_timeout_s)") from None
        except RequestError:
            self.counters["rejected"] += 1
            raise

    # ------------------------------------------------------------------ the decode thread

    def _outer_timeout(self) -> float:
        """The limit on a request's whole prepare step. In the thread it is decode_timeout_s; with
        decode workers that limit is theirs (they are killed), and this only backstops the fetch
        and the header probe (plus a worker's start-up, which is not counted against the file)."""
        c = self.serve_cfg
        if self.decoders is None:
            return c.decode_timeout_s
        return c.decode_timeout_s + c.fetch_timeout_s + BOOT_TIMEOUT_S

    def _featurize_in_worker(self, path: str, annotation: Any) -> Sample:
        """Decode in a worker (media only), then encode here with the replica's encoders."""
        try:
            media = self.decoders.decode(path, annotation, self.serve_cfg.decode_timeout_s)
        except DecodeTimeout:
            self.counters["decode_workers_killed"] += 1
            raise RequestError(422, "decode_timeout", f"decoding the video took longer than "
                               f"{self.serve_cfg.decode_timeout_s} s (serve.decode_timeout_s)") from None
        with self._encode_lock:
            return self.encoders.encode(media, annotation)

    def _prepare_uri(self, video: str) -> tuple[Sample, dict[str, float]]:
        t0 = time.perf_counter()
        source = self.policy.resolve(video)
        with materialize(source, self.serve_cfg.max_upload_bytes, self.serve_cfg.fetch_timeout_s,
                         self.serve_cfg.upload_dir or None) as path:
            timings = {"fetch_s": time.perf_counter() - t0}
            return self._prepare_local(path, source.name, timings)

    def _prepare_local(self, path: str, name: str, timings: dict[str, float]) -> tuple[Sample, dict[str, float]]:
        limits = self.serve_cfg
        size = os.path.getsize(path)
        if size == 0:
            raise RequestError(400, "empty_file", f"{name!r} is empty (0 bytes)")
        if size > limits.max_upload_bytes:
            raise RequestError(413, "too_large", f"{name!r} is {size} bytes, over the limit of {limits.max_upload_bytes} (serve.max_upload_bytes)")
        t0 = time.perf_counter()
        probe = probe_video(path, name)
        if probe.duration is not None and probe.duration > limits.max_duration_s:
            raise RequestError(422, "too_long", f"{name!r} lasts {probe.duration:.1f} s, over the limit of {limits.max_duration_s} s (serve.max_duration_s)")
        if probe.width * probe.height > limits.max_frame_pixels:
            raise RequestError(422, "too_many_pixels", f"{name!r} is {probe.width}x{probe.height}, over the limit of "
                               f"{limits.max_frame_pixels} pixels per frame (serve.max_frame_pixels)")
        timings["probe_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            sample = self._featurize(path, Unannotated(safe_video_id(name), source="serve"))
        except RequestError:
            raise
        except Exception as e:  # decoding client data: every failure is the client's video
            log.info("decode failed for %s: %s", name, e)
            raise _media_error(e, path, name) from None
        timings["features_s"] = time.perf_counter() - t0
        if not (math.isfinite(sample.duration) and sample.duration <= limits.max_duration_s):
            raise RequestError(422, "too_long", f"{name!r} lasts {sample.duration:.1f} s, over the limit of {limits.max_duration_s} s (serve.max_duration_s)")
        unannotated = {"events": []} if hasattr(sample, "events") else {}  # a ReleaseVideo (online release encoders) has none
        return dataclasses.replace(sample, video_id=safe_video_id(name), **unannotated), timings

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict[str, Any]:
        c = self.serve_cfg
        return {
            "model": self.card.model_id,
            "source": self.card.source,
            "device": self.card.device,
            "config_hash": self.config_hash,
            "features_hash": section_hash(self.cfg.features),
            "decoding": dataclasses.asdict(self.cfg.infer),
            "engine": self.engine().describe() if hasattr(self.engine(), "describe") else {},
            "options": {name: {"type": f.annotation.__args__[0].__name__ if hasattr(f.annotation, "__args__") else str(f.annotation),
                               "description": f.description}
                        for name, f in CaptionOptions.model_fields.items()},
            "limits": {"max_upload_bytes": c.max_upload_bytes, "max_duration_s": c.max_duration_s,
                       "decode_timeout_s": c.decode_timeout_s, "max_frame_pixels": c.max_frame_pixels,
                       "max_json_bytes": c.max_json_bytes},
            **self.card.extra,
        }

    def resources(self) -> dict[str, Any]:
        """What this replica holds now (a long soak watches these return to zero when idle): its
        process id, requests in flight, KV pages allocated or promised to admitted videos, live
        decode worker processes."""
        pool = getattr(self._engine, "pool", None)
        return {"pid": os.getpid(), "in_flight": self.in_flight,
                "kv_pages_in_use": (pool.usable - pool.free_pages) if pool is not None else 0,
                "decode_workers": self.decoders.count() if self.decoders is not None else 0}

    def health(self) -> dict[str, Any]:
        """/healthz: "ok", or "engine_failed" after a device fault (the replica is about to be replaced); the
        engines this replica built (1 once a Serve replica is up: built at start, before its first request)."""
        fault = self._batcher.fault
        return {"status": "ok" if fault is None else "engine_failed", "model": self.card.model_id,
                "engine": {"builds": self.engine_builds, "built_at_start": self.engine_built_at_start,
                           "fault": fault.describe() if fault is not None else None},
                "requests": dict(self.counters), "resources": self.resources()}

    def check_health(self) -> None:
        """Ray Serve's health check (the deployment inherits it): raises once the engine hit a device fault
        (a CUDA error poisons the process: infer/engine/faults.py), so Serve replaces this replica instead
        of sending it more requests."""
        fault = self._batcher.fault
        if fault is not None:
            raise RuntimeError(f"the engine hit a device fault and cannot be reused: {fault.describe()}")

    def close(self) -> None:
        if self.decoders is not None:
            self.decoders.close()
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        self._batcher.close()
