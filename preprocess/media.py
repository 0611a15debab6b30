"""Per-video media decoding: sampled RGB frames, segment times and 16 kHz mono audio.

Called once per video by the preprocessing job (and by serving); pure python, no ray.

    decoded = decode_video("s3://bucket/videos/abc.mp4", cfg.features)
    decoded.frames         # uint8 [N, H, W, 3], N = T * frames_per_segment
    decoded.segment_times  # float32 [T, 2], seconds, last end == duration
    decoded.audio          # float32 [S] at cfg.features.sample_rate, or None

Reading. Local paths (or file://) are read in place. Any other fsspec URI (s3://
through s3fs, ...) is streamed in 8 MiB chunks into one temporary file, which is
deleted when the context of `open_media` exits. We do not hand decord a file
object: decord 0.6 `VideoReader(f)` / `AudioReader(f)` call `bytearray(f.read())`,
i.e. they hold the whole file in RAM, twice while the copy is made, and the audio
would need a second full read. The temporary file is bounded by
`features.max_media_bytes` (checked before and while downloading) and is the only
copy. S3 settings come from `storage_options` (fsspec/s3fs keyword arguments) or,
when it is None, from `pipeline.storage.storage_options` (the AWS_* environment,
AWS_ENDPOINT_URL for S3-compatible servers), like every other path of a run.

Decoding. Video frames come from decord, resized on decode to image_size x
image_size (aspect not kept; image_size=0 keeps the source size). Audio comes
from PyAV: decord's AudioReader returns NaN for mono=False and overshoots
when resampling, PyAV's swresample does not. Channels are averaged (not
ffmpeg's +3 dB downmix) and the signal is placed on the video timeline (time 0 =
first video frame), then padded/trimmed to exactly round(duration * sample_rate)
samples. A video without an audio track is valid: has_audio=False, audio=None.
Container metadata (title, comment tags) is read with undecodable bytes replaced:
cameras and old muxers write Latin-1 / GBK tags, and PyAV's strict UTF-8 default
would reject an otherwise valid file for a tag we never use.

Timeline. duration = what a player shows, from the first video frame: the container's
stated end when the frames start before it, else the video stream's own stated end, else
the end of the last video frame (its pts + frame duration), checked against the demuxed
frame times; see preprocess/timing.py (variable frame rates, edit lists, truncated
containers, timing that cannot be trusted).
Frames are sampled by `frame_schedule` (see there for the exact count and segment rules).
Every problem with a file raises `MediaError`
whose `kind` is one of MediaError.KINDS and whose message says what is wrong.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import FeaturesConfig
from preprocess.media_errors import MediaError
from preprocess.timing import Timing, read_timing, video_duration

CHUNK_BYTES = 8 * 1024 * 1024
_MP4_EXTENSIONS = {".mp4", ".m4v", ".mov", ".m4a", ".3gp"}
METADATA_ERRORS = "replace"  # how PyAV decodes non-UTF-8 metadata tags (its default "strict" raises)


@dataclass
class DecodedVideo:
    """One decoded video, ready for the feature encoders."""

    frames: np.ndarray  # uint8 [N, H, W, 3], N = T * frames_per_segment (padded by repeating the last)
    segment_times: np.ndarray  # float32 [T, 2] start/end (s) of each segment
    audio: np.ndarray | None  # float32 [S] mono, S = round(duration * sample_rate); None without audio
    sample_rate: int
    duration: float  # seconds, from the video stream
    has_audio: bool

    @property
    def num_segments(self) -> int:
        return int(self.segment_times.shape[0])


# --------------------------------------------------------------------------- schedule


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def frame_schedule(duration: float, cfg: FeaturesConfig) -> tuple[np.ndarray, np.ndarray]:
    """Sample times and segments for a video of `duration` seconds.

    Returns (frame_times float32 [T*f], segment_times float32 [T, 2]), f = frames_per_segment.

    count policy (the paper's rule): n = clip(round(duration / seconds_per_frame),
      min_frames, max_frames), then rounded up to a multiple of f (down if that
      passes max_frames), as Qwen2.5-VL rounds its frame count to its temporal patch
      of 2. step = duration / n; frame i stands for time (i + 0.5) * step; segment t
      covers [t*d, (t+1)*d] with d = f * step, so all T = n / f segments are equal and
      the last ends exactly at the duration. No padding is needed.
    fps policy: step = 1 / fps and n = ceil(duration * fps) (if n > max_frames the
      count rule with n = max_frames applies instead). Frame i stands for
      min((i + 0.5) * step, duration); T = ceil(n / f); if n is not a multiple of f
      the last segment is padded by repeating the last frame (and its time);
      segment t covers [t*f*step, min((t+1)*f*step, duration)], the last one ends at
      the duration (so it may be shorter than the others).
    """
    if not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"duration must be positive, got {duration}")
    f = cfg.frames_per_segment
    if f < 1 or cfg.min_frames < 1 or cfg.max_frames < max(cfg.min_frames, f):
        raise ValueError(f"bad frame settings: frames_per_segment={f}, min_frames={cfg.min_frames}, max_frames={cfg.max_frames}")

    def count_rule(n: int) -> int:
        up = -(-n // f) * f
        return up if up <= cfg.max_frames else (cfg.max_frames // f) * f

    if cfg.frame_policy == "count":
        if cfg.seconds_per_frame <= 0:
            raise ValueError(f"seconds_per_frame must be positive, got {cfg.seconds_per_frame}")
        n = count_rule(min(max(_round_half_up(duration / cfg.seconds_per_frame), cfg.min_frames), cfg.max_frames))
        step = duration / n
    elif cfg.frame_policy == "fps":
        if cfg.fps <= 0:
            raise ValueError(f"fps must be positive, got {cfg.fps}")
        n = max(1, math.ceil(duration * cfg.fps - 1e-6))
        step = 1.0 / cfg.fps
        if n > cfg.max_frames:
            n = count_rule(cfg.max_frames)
            step = duration / n
    else:
        raise ValueError(f"unknown frame_policy {cfg.frame_policy!r}")
    t_count = -(-n // f)
    times = np.minimum((np.arange(n, dtype=np.float64) + 0.5) * step, duration)
    times = np.concatenate([times, np.full(t_count * f - n, times[-1])])
    starts = np.arange(t_count, dtype=np.float64) * f * step
    ends = np.minimum(starts + f * step, duration)
    ends[-1] = duration
    return times.astype(np.float32), np.stack([starts, ends], axis=1).astype(np.float32)


# --------------------------------------------------------------------------- reading


def _check_size(uri: str, size: int, max_bytes: int) -> None:
    if size == 0:
        raise MediaError(f"zero-byte file: {uri}", "empty")
    if max_bytes > 0 and size > max_bytes:
        raise MediaError(f"file is {size} bytes, over features.max_media_bytes={max_bytes}: {uri}", "too_large")


@contextlib.contextmanager
def open_media(uri: str, storage_options: dict[str, Any] | None = None, max_bytes: int = 0) -> Iterator[str]:
    """Context manager yielding a local path for `uri` (a temp copy for remote URIs, removed on exit).

    Raises MediaError: missing (no such file/object), empty (zero bytes), too_large.
    """
    if uri.startswith("file://") or "://" not in uri:  # local: read in place
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        if not os.path.isfile(path):
            raise MediaError(f"missing file: {uri}", "missing")
        _check_size(uri, os.path.getsize(path), max_bytes)
        yield path
        return

    import fsspec

    from pipeline.storage import storage_options as default_storage_options

    options = default_storage_options(uri) if storage_options is None else storage_options
    try:
        fs, rpath = fsspec.core.url_to_fs(uri, **options)
        size = int(fs.size(rpath))
    except FileNotFoundError as e:
        raise MediaError(f"missing file: {uri}", "missing") from e
    _check_size(uri, size, max_bytes)
    fd, tmp = tempfile.mkstemp(prefix="padcap-media-", suffix=Path(rpath).suffix.lower())
    try:
        written = 0
        with os.fdopen(fd, "wb") as out, fs.open(rpath, "rb", block_size=CHUNK_BYTES) as src:
            while chunk := src.read(CHUNK_BYTES):
                written += len(chunk)
                if max_bytes > 0 and written > max_bytes:
                    raise MediaError(f"download passed features.max_media_bytes={max_bytes}: {uri}", "too_large")
                out.write(chunk)
        if written == 0:
            raise MediaError(f"zero-byte file: {uri}", "empty")
        yield tmp
    finally:
        Path(tmp).unlink(missing_ok=True)


def _sniff(path: str, uri: str) -> None:
    """Cheap structural check before decoding: text files and cut-off MP4 box layouts."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(4096)
        if b"\x00" not in head:
            try:
                head.decode("utf-8")
                raise MediaError(f"a text file, not a video ({size} bytes of text): {uri}", "not_media")
            except UnicodeDecodeError:
                pass
        if Path(path).suffix.lower() not in _MP4_EXTENSIONS or head[4:8] != b"ftyp":
            return
        # Walk the top-level ISO-BMFF boxes: a box running past the end means the file was cut.
        pos, seen = 0, set()
        while pos + 8 <= size:
            fh.seek(pos)
            header = fh.read(16)
            box_size, box_type = int.from_bytes(header[:4], "big"), header[4:8]
            if box_size == 1 and len(header) >= 16:
                box_size = int.from_bytes(header[8:16], "big")
            elif box_size == 0:  # box runs to the end of the file
                box_size = size - pos
            if box_size < 8:
                raise MediaError(f"corrupt mp4: bad box header at byte {pos}: {uri}", "undecodable")
            seen.add(box_type)
            if pos + box_size > size:
                raise MediaError(
                    f"truncated mp4: box {box_type.decode('latin-1')!r} at byte {pos} needs {box_size} bytes, "
                    f"the file has {size - pos} left: {uri}",
                    "truncated",
                )
            pos += box_size
        if b"moov" not in seen:
            raise MediaError(f"truncated or incomplete mp4: no 'moov' index box: {uri}", "truncated")


@dataclass
class _Probe:
    has_audio: bool
    video_start: float  # seconds
    timing: Timing | None = None  # the demuxer's view of the video timeline (None: no video packets)


def probe_video(path: str, uri: str) -> _Probe:
    """A local media file's streams, after the sniff; MediaError (not_media, no_video, ...) when it holds no video."""
    import av

    _sniff(path, uri)
    try:
        with av.open(path, metadata_errors=METADATA_ERRORS) as container:
            vs = container.streams.video
            aus = container.streams.audio
            if not vs:
                what = "an audio-only file" if aus else "a container without streams"
                raise MediaError(f"no video stream ({what}): {uri}", "no_video")
            v = vs[0]
            if v.codec_context is None:  # PyAV leaves it unset when no decoder matches the codec tag
                raise MediaError(f"video stream uses a codec this build has no decoder for: {uri}", "undecodable")
            start = float(v.start_time * v.time_base) if v.start_time is not None and v.time_base else 0.0
            return _Probe(bool(aus), start, read_timing(container))
    except av.error.FFmpegError as e:
        raise MediaError(f"not a readable media container ({e.__class__.__name__}: {e}): {uri}", "not_media") from e


def _read_frames(path: str, uri: str, cfg: FeaturesConfig, timing: Timing | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """decord: -> (frames uint8 [N,H,W,3], segment_times [T,2], duration).

    The duration is `timing.video_duration`'s (what a player shows, checked against the
    frames; VFR files: decord's guess for the last frame is off), else decord's end of the
    last frame.
    """
    import decord

    size = cfg.image_size if cfg.image_size > 0 else -1
    try:
        vr = decord.VideoReader(path, width=size, height=size, num_threads=cfg.decode_threads)
        count = len(vr)
        fps = float(vr.get_avg_fps())
        stamps = np.asarray(vr.get_frame_timestamp(np.arange(count)), dtype=np.float64).reshape(count, 2)
    except Exception as e:  # decord raises DECORDError / RuntimeError / AssertionError
        raise MediaError(f"video stream cannot be opened by decord ({_first_line(e)}): {uri}", "undecodable") from e
    starts = stamps[:, 0] - stamps[0, 0]
    duration = round(float(stamps[-1, 1] - stamps[0, 0]), 6)  # decord's stamps are float32-ish
    declared = video_duration(timing, fps, uri) if timing is not None else None
    if declared is not None:
        duration = round(declared, 6)
    if not (math.isfinite(duration) and duration > 0):
        duration = count / fps if fps > 0 else 0.0
        starts = np.arange(count) / fps if fps > 0 else starts
    if not duration > 0:
        raise MediaError(f"video stream has no usable timing (fps={fps}, frames={count}): {uri}", "undecodable")
    frame_times, segment_times = frame_schedule(duration, cfg)
    index = np.clip(np.searchsorted(starts, frame_times, side="right") - 1, 0, count - 1)
    unique, inverse = np.unique(index, return_inverse=True)
    try:
        batch = vr.get_batch(unique.tolist()).asnumpy()
    except Exception as e:
        raise MediaError(f"video frames cannot be decoded ({_first_line(e)}): {uri}", "undecodable") from e
    return np.ascontiguousarray(batch[inverse]), segment_times, duration


def _read_audio(path: str, uri: str, sample_rate: int, offset: float, duration: float) -> np.ndarray | None:
    """PyAV: first audio stream -> float32 [round(duration*sr)] mono on the video timeline.

    None when the stream holds no audio frames at all (treated like no audio track).
    """
    import av

    pieces: list[np.ndarray] = []
    first_time: float | None = None
    try:
        with av.open(path, metadata_errors=METADATA_ERRORS) as container:
            stream = container.streams.audio[0]
            resampler = None
            for frame in container.decode(stream):
                if first_time is None:
                    first_time = float(frame.time) if frame.time is not None else 0.0
                    resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=sample_rate)
                pieces.extend(out.to_ndarray().mean(axis=0) for out in resampler.resample(frame))
            if resampler is not None:
                pieces.extend(out.to_ndarray().mean(axis=0) for out in resampler.resample(None))
    except (av.error.FFmpegError, ValueError) as e:  # ValueError: format change mid-stream
        raise MediaError(f"audio stream cannot be decoded ({e.__class__.__name__}: {e}): {uri}", "undecodable") from e
    if not pieces:
        return None
    total = _round_half_up(duration * sample_rate)
    audio = np.concatenate(pieces).astype(np.float32)
    shift = _round_half_up(((first_time or 0.0) - offset) * sample_rate)
    if shift > 0:
        audio = np.concatenate([np.zeros(shift, np.float32), audio])
    elif shift < 0:
        audio = audio[-shift:]
    if audio.size < total:
        audio = np.pad(audio, (0, total - audio.size))
    audio = audio[:total]
    if not np.isfinite(audio).all():
        raise MediaError(f"audio stream decodes to NaN/inf samples: {uri}", "undecodable")
    return audio


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else e.__class__.__name__)[:300]


def decode_video(uri: str, cfg: FeaturesConfig, storage_options: dict[str, Any] | None = None) -> DecodedVideo:
    """Decode `uri` (local path or fsspec URI) into sampled frames, segments and audio.

    Raises MediaError (kinds: missing, empty, too_large, not_media, truncated, no_video,
    undecodable). See the module docstring and `frame_schedule` for the exact rules.
    """
    with open_media(uri, storage_options, cfg.max_media_bytes) as path:
        probe = probe_video(path, uri)
        frames, segment_times, duration = _read_frames(path, uri, cfg, probe.timing)
        audio = _read_audio(path, uri, cfg.sample_rate, probe.video_start, duration) if probe.has_audio else None
    return DecodedVideo(
        frames=frames,
        segment_times=segment_times,
        audio=audio,
        sample_rate=cfg.sample_rate,
        duration=duration,
        has_audio=audio is not None,
    )
