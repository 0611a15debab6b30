"""Small real test videos written with PyAV (H.264 + AAC in mp4), for media/encoder tests.

    write_mp4(path, frames, fps=8, audio=tone(440, 4.0), sample_rate=44100, layout="stereo")
    solid_frames(n, h, w, [(255, 0, 0), (0, 0, 255)])   # colour runs, equal parts
    moving_square(n, h, w, dx=1, dy=0)                  # white square on black, moving
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np


def tone(freq: float, seconds: float, sample_rate: int = 44100, amplitude: float = 0.5, silent_until: float = 0.0) -> np.ndarray:
    """float32 [S] sine, zero before `silent_until` seconds."""
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    return (amplitude * np.sin(2 * np.pi * freq * t) * (t >= silent_until)).astype(np.float32)


def solid_frames(n: int, h: int, w: int, colours: list[tuple[int, int, int]]) -> np.ndarray:
    """uint8 [n, h, w, 3]: the colours one after another, in equal runs."""
    frames = np.zeros((n, h, w, 3), np.uint8)
    for i in range(n):
        frames[i] = colours[min(len(colours) - 1, i * len(colours) // n)]
    return frames


def moving_square(n: int, h: int, w: int, dx: int, dy: int, size: int | None = None) -> np.ndarray:
    """uint8 [n, h, w, 3]: a white square moving (dx, dy) pixels per frame from the centre."""
    size = size or min(h, w) // 3
    frames = np.zeros((n, h, w, 3), np.uint8)
    x0 = (w - size) // 2 - dx * n // 2
    y0 = (h - size) // 2 - dy * n // 2
    for i in range(n):
        x, y = x0 + dx * i, y0 + dy * i
        frames[i, max(0, y) : max(0, y + size), max(0, x) : max(0, x + size)] = 255
    return frames


def write_mp4(path: str | Path, frames: np.ndarray | None, fps: int = 8, audio: np.ndarray | None = None,
              sample_rate: int = 44100, layout: str = "stereo") -> Path:
    """Encode frames (uint8 [N, H, W, 3], even H and W) and/or mono float32 audio into an mp4."""
    import av  # imported here so modules using only the array helpers load without PyAV

    path = Path(path)
    with av.open(str(path), mode="w", format="mp4") as out:
        vs = None
        if frames is not None:
            vs = out.add_stream("libx264", rate=Fraction(fps))
            vs.height, vs.width = frames.shape[1:3]
            vs.pix_fmt = "yuv420p"
            vs.options = {"crf": "10", "preset": "ultrafast", "bf": "0"}
        aus = None
        if audio is not None:
            aus = out.add_stream("aac", rate=sample_rate)
            aus.layout = layout
        if vs is not None:
            for i, img in enumerate(frames):
                vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
                vf.pts, vf.time_base = i, Fraction(1, fps)
                out.mux(vs.encode(vf))
            out.mux(vs.encode(None))
        if aus is not None:
            channels = 2 if layout == "stereo" else 1
            for start in range(0, audio.shape[0], 1024):
                piece = np.ascontiguousarray(np.repeat(audio[None, start : start + 1024], channels, axis=0))
                af = av.AudioFrame.from_ndarray(piece, format="fltp", layout=layout)
                af.sample_rate, af.pts, af.time_base = sample_rate, start, Fraction(1, sample_rate)
                out.mux(aus.encode(af))
            out.mux(aus.encode(None))
    return path


_CODECS = {"mp4": ("mp4", "libx264"), "mkv": ("matroska", "libx264"), "webm": ("webm", "libvpx-vp9"), "avi": ("avi", "mpeg4")}


def write_timed(path: str | Path, times: list[float], last: float, audio_seconds: float = 0.0, size: tuple[int, int] = (48, 64)) -> Path:
    """A video whose frames start at `times` (seconds; variable frame rate allowed), the last lasting `last` s.

    The container comes from the suffix (.mp4, .mkv, .webm, .avi). Each packet carries its
    true duration (next start - start), as a phone's muxer writes it. The codec's time base
    is set as well as the stream's: with only the stream's, PyAV encodes pts in 1/rate units.
    AVI is constant-rate by design: the time base is 1/30 s and a VFR file is one with gaps
    (dropped ticks). `audio_seconds` > 0 adds a silent mono track of that length.
    """
    import av

    path = Path(path)
    fmt, codec = _CODECS[path.suffix.lstrip(".")]
    tb = Fraction(1, 30) if fmt == "avi" else Fraction(1, 1000)
    ends = list(times[1:]) + [times[-1] + last]
    length = {int(round(t / tb)): int(round((e - t) / tb)) for t, e in zip(times, ends)}
    with av.open(str(path), mode="w", format=fmt) as out:
        vs = out.add_stream(codec, rate=30)
        vs.height, vs.width = size
        vs.pix_fmt = "yuv420p"
        if codec == "libx264":
            vs.options = {"preset": "ultrafast", "bf": "0"}
        vs.codec_context.time_base = tb
        vs.time_base = tb
        aus = None
        if audio_seconds > 0:
            aus = out.add_stream("libopus" if fmt == "webm" else "aac", rate=48000)
            aus.layout = "mono"

        def mux(packets):
            for packet in packets:
                if packet.pts is not None:
                    packet.duration = length[round(packet.pts * packet.time_base / tb)]
                out.mux(packet)

        for i, t in enumerate(times):
            img = np.full((*size, 3), (i * 37) % 256, np.uint8)
            vf = av.VideoFrame.from_ndarray(img, format="rgb24")
            vf.pts, vf.time_base = int(round(t / tb)), tb
            mux(vs.encode(vf))
        mux(vs.encode(None))
        if aus is not None:
            samples = int(audio_seconds * 48000)
            for start in range(0, samples, 960):
                af = av.AudioFrame.from_ndarray(np.zeros((1, min(960, samples - start)), np.float32), format="fltp", layout="mono")
                af.sample_rate, af.pts, af.time_base = 48000, start, Fraction(1, 48000)
                out.mux(aus.encode(af))
            out.mux(aus.encode(None))
    return path
