"""A video's length as a player shows it, from its container, checked against the frames it holds.

decord ends the last frame at its pts plus the packet duration, or plus one frame of the
*average* frame rate when the packet carries none. For a variable-frame-rate file (a phone
that drops to 2 fps in the dark) that guess is far off, and for a container cut short
(a download stopped half way) the decoded frames simply stop, so both give a wrong,
silently shorter `ok` video. Here one demux pass (packets only, nothing decoded) reads

  - the frames' presentation times (first, last, the longest gap between two frames)
    and the last packet's own duration: the *decoded span*;
  - the container's stated end, for the formats whose header states it (mp4/mov, Matroska,
    WebM, AVI; for others ffmpeg estimates it from the bit rate, which proves nothing);
  - the video stream's own stated end: the stream duration (mp4 `mdhd`/edit list, AVI
    `strh`), else Matroska/WebM's per-track DURATION tag, counted from the stream's start
    time (edit-list offsets applied);

all on the video timeline (0 = the first video frame), and `video_duration` decides:

  - the length is the container's stated end when its video frames start before it: a
    player shows the last frame until then. ffmpeg's VFR mp4s state a video stream
    duration that ends before (B-frames) or exactly where (-bf 0) their last frame starts,
    and Matroska/WebM track tags end one average frame after it; neither is what plays;
  - without a container end (or with the last frame starting right at it), the stream's own
    end when its frames start before that, else the decoded end (decord's, as before);
  - `bad_timing` only where the file contradicts itself: video frames that start after
    the container's end, or frame times that do not increase (repeat after reordering);
  - `truncated` where the packets (of any stream) stop short of the container's end by
    more than one frame interval (the longest gap between consecutive frames, at least one
    average frame, plus `SLACK_S`), where the video frames stop that short of a stream's
    stated end with no container end to go by, or where the demuxer fails part way.

A truncation that loses less than one frame interval is not detectable this way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from preprocess.media_errors import MediaError

SLACK_S = 0.05  # rounding of time bases, audio priming: differences below this mean nothing
_DECLARING_FORMATS = ("mov", "mp4", "matroska", "webm", "avi")
_TAG_DURATION = re.compile(r"^(\d+):(\d{2}):(\d{2}(?:\.\d+)?)$")


@dataclass(frozen=True)
class Timing:
    """What the demuxer says about one file's video timeline (seconds)."""

    last_start: float  # of the last frame, relative to the first's presentation time
    last_duration: float  # the last packet's own duration (0 when it carries none)
    max_gap: float  # longest gap between consecutive frame starts (0 for one frame)
    frames: int
    increasing: bool  # frame start times strictly increase
    declared: float | None  # the video stream's stated end, relative to the first frame
    declared_by: str  # where `declared` comes from
    container_end: float | None  # container's stated end, relative to the first frame
    streams_end: float  # end of the last packet of any stream, relative to the first frame
    demux_error: str | None

    @property
    def decoded_end(self) -> float:
        return self.last_start + self.last_duration


def _tag_seconds(text: str | None) -> float | None:
    match = _TAG_DURATION.match((text or "").strip())
    if not match:
        return None
    h, m, s = match.groups()
    return int(h) * 3600 + int(m) * 60 + float(s)


def read_timing(container) -> Timing | None:
    """One demux pass over an open PyAV input container; None without video packets."""
    import av

    video = container.streams.video[0]
    pts: list[float] = []
    durations: dict[float, float] = {}
    ends = -math.inf
    error = None
    try:
        for packet in container.demux():
            if packet.pts is None or packet.time_base is None:
                continue
            start = float(packet.pts * packet.time_base)
            length = float((packet.duration or 0) * packet.time_base)
            ends = max(ends, start + length)
            if packet.stream.index == video.index:
                pts.append(start)
                durations[start] = length
    except (av.error.FFmpegError, OSError) as e:
        error = f"{e.__class__.__name__}: {e}"
    if not pts:
        return None
    order = sorted(pts)
    first, last = order[0], order[-1]
    gaps = [b - a for a, b in zip(order, order[1:])]
    length, declared_by = None, ""
    if video.duration and video.time_base:
        length, declared_by = float(video.duration * video.time_base), "stream duration"
    elif (tag := _tag_seconds(video.metadata.get("DURATION"))) is not None:
        length, declared_by = tag, "track DURATION tag"
    # both count from the stream's start time (an mp4 edit list's offset, a B-frame delay)
    stream_start = float((video.start_time or 0) * video.time_base) if video.time_base else 0.0
    declared = None if length is None else stream_start + length - first
    container_end = None
    if container.duration and any(name in _DECLARING_FORMATS for name in container.format.name.split(",")):
        start = (container.start_time or 0) / 1e6
        container_end = start + container.duration / 1e6 - first
    return Timing(
        last_start=last - first,
        last_duration=durations.get(last, 0.0),
        max_gap=max(gaps, default=0.0),
        frames=len(order),
        increasing=len(set(order)) == len(order),
        declared=declared,
        declared_by=declared_by,
        container_end=container_end,
        streams_end=ends - first,
        demux_error=error,
    )


def video_duration(t: Timing, avg_fps: float, uri: str) -> float | None:
    """The video's length in seconds as a player shows it (see the module docstring), None when
    neither the container nor the stream states an end the frames are within.

    Raises MediaError (bad_timing / truncated) saying what disagrees.
    """
    span = f"{t.frames} frames from 0 to {t.last_start:.3f} s"
    if t.demux_error:
        raise MediaError(f"truncated or corrupt container: the demuxer failed after {span} ({t.demux_error}): {uri}", "truncated")
    if not t.increasing:
        raise MediaError(f"untrustworthy timing: frame timestamps repeat ({span}): {uri}", "bad_timing")
    interval = max(t.max_gap, 1.0 / avg_fps if avg_fps > 0 else 0.0) + SLACK_S
    if t.container_end is not None:
        if t.last_start > t.container_end + SLACK_S:
            raise MediaError(f"untrustworthy timing: the container says it ends at {t.container_end:.3f} s, "
                             f"before its last video frame starts ({span}): {uri}", "bad_timing")
        packets_end = max(t.streams_end, t.decoded_end)
        if t.container_end - packets_end > interval:
            raise MediaError(f"truncated: the container declares {t.container_end:.3f} s but its packets end at "
                             f"{packets_end:.3f} s ({span}): {uri}", "truncated")
        if t.container_end > t.last_start:
            return t.container_end  # the last frame is shown until the container's end
    if t.declared is not None and t.declared > t.last_start:
        if t.container_end is None and t.declared - t.decoded_end > interval:
            raise MediaError(f"truncated: the {t.declared_by} declares {t.declared:.3f} s but the video frames stop "
                             f"at {t.decoded_end:.3f} s ({span}): {uri}", "truncated")
        return t.declared
    return t.decoded_end if t.last_duration > 0 else None
