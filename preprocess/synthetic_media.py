"""Rendering and muxing for the synthetic corpus: frames, waveform, and the .mp4 file.

Pure numpy rendering (deterministic for a given `numpy.random.Generator`) plus a
PyAV writer that encodes H.264 (libx264, one thread, fixed options, its portable C
code only) and AAC into an mp4. Used by `preprocess/synthetic.py`; not run on its own.

    frames = render_frames(script, rng)              # uint8 [N, H, W, 3]
    audio = render_audio(script, rng)                # float32 [S] in [-1, 1]
    write_mp4(path, frames, audio, fps, sample_rate)

Every visual pattern is a large shape (about half the frame) in a saturated colour
over a dark-grey noisy background, so colour survives a 32x32 downsample and
mean pooling; every sound occupies its own frequency band or texture. In the hard
regime an event has a lane (half size, top-left or bottom-right quadrant) so two
concurrent events are both visible, concurrent sounds add, and a script's distractors
(`SoundSpec`, sounds that belong to no event) are mixed in after the events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

# RGB of each colour word (saturated, far apart, all far from the background).
COLOUR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 190, 50),
    "blue": (40, 70, 235),
    "yellow": (240, 225, 30),
    "purple": (150, 40, 200),
    "orange": (250, 135, 20),
    "white": (245, 245, 245),
    "cyan": (30, 220, 230),
}
BACKGROUND_RGB = (48, 48, 48)
BACKGROUND_NOISE = 3.0  # std of the per-pixel Gaussian noise, 0..255 scale
BACKGROUND_AUDIO_STD = 0.001  # very quiet noise between events (about -60 dBFS)

# Sound parameters (Hz, seconds); AAC keeps all of them (all well under 8 kHz).
TONE_HZ = {"low beep": 250.0, "mid beep": 700.0, "high beep": 2000.0}
PULSE_HZ = 1200.0
PULSE_PERIOD = 0.25  # on for the first half of each period
CHIRP_RANGE = {"rising chirp": (400.0, 1400.0), "falling chirp": (3500.0, 1500.0)}
CHIRP_PERIOD = 0.25  # one sweep per period, so every 0.5 s window holds two sweeps
TONE_AMPLITUDE = 0.3
NOISE_STD = 0.12
FADE_SECONDS = 0.005

BLINK_PERIOD = 1.0  # seconds; the shape is visible for the half centred on the event midpoint
BASE_SIZE = 0.55  # shape size as a fraction of min(width, height)
MOVE_SPAN = 0.4  # centre travels this fraction of the frame
# The hard regime's two lanes (an event's `lane` >= 0): the pattern at LANE_SCALE of its size
# and travel, centred in the top-left or the bottom-right quadrant, so two concurrent events
# land in different patches of the pixel encoder's 2x2 grid. lane -1: centred, full size.
LANE_CENTRES: tuple[tuple[float, float], ...] = ((0.28, 0.28), (0.72, 0.72))
LANE_SCALE = 0.5


@dataclass(frozen=True)
class EventSpec:
    """One event of a synthetic video: frame interval [start_frame, end_frame) and its attributes."""

    start_frame: int
    end_frame: int
    colour: str
    shape: str
    motion: str
    sound: str
    lane: int = -1  # -1: centred, full size (default regime); 0 / 1: LANE_CENTRES (hard regime)


@dataclass(frozen=True)
class SoundSpec:
    """An audio-only sound on frame interval [start_frame, end_frame): a distractor that
    belongs to no event (hard regime), so it is in the audio track and in no annotation."""

    start_frame: int
    end_frame: int
    sound: str


@dataclass(frozen=True)
class VideoScript:
    """Everything needed to render one video deterministically."""

    video_id: str
    split: str
    num_frames: int
    fps: int
    sample_rate: int
    width: int
    height: int
    events: tuple[EventSpec, ...]
    entropy: tuple[int, ...]  # seeds the rendering noise: numpy SeedSequence entropy
    distractors: tuple[SoundSpec, ...] = ()

    @classmethod
    def of(cls, cfg, index: int, split: str, num_frames: int, events, distractors=()) -> VideoScript:
        """Video `index` of the corpus `cfg` (a SyntheticConfig): its id, frame size, rates and rendering seed."""
        return cls(video_id=f"synth_{index:05d}", split=split, num_frames=num_frames, fps=cfg.fps,
                   sample_rate=cfg.sample_rate, width=cfg.width, height=cfg.height, events=tuple(events),
                   entropy=(int(cfg.seed), int(index), 1), distractors=tuple(distractors))

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps

    @property
    def num_samples(self) -> int:
        return int(round(self.num_frames * self.sample_rate / self.fps))

    def sample_index(self, frame: int) -> int:
        """Audio sample index at the start of video frame `frame`."""
        return int(round(frame * self.sample_rate / self.fps))


# --------------------------------------------------------------------------- frames


def _shape_mask(shape: str, xx: np.ndarray, yy: np.ndarray, cx: float, cy: float, size: float) -> np.ndarray:
    """Boolean [H, W] mask of `shape` centred at (cx, cy) with side/diameter `size` pixels."""
    dx, dy, half = xx - cx, yy - cy, size / 2.0
    if shape == "circle":
        return dx * dx + dy * dy <= half * half
    if shape == "square":
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "triangle":  # apex up; 1.25x larger so its area is close to the others
        half = half * 1.25
        return (dy <= half) & (np.abs(dx) <= (dy + half) * 0.5)
    if shape == "stripes":  # a square of five horizontal bands: colour, gap, colour, gap, colour
        band = np.floor((dy + half) / (size / 5.0))
        return (np.abs(dx) <= half) & (np.abs(dy) <= half) & (band % 2 == 0)
    raise ValueError(f"unknown shape {shape!r}")


def _placement(motion: str, progress: float, t: float, t_mid: float, w: int, h: int) -> tuple[float, float, float, bool]:
    """(cx, cy, size, visible) of the shape at `progress` in (0, 1) through its event."""
    side = min(w, h)
    cx, cy, size, visible = w / 2.0, h / 2.0, BASE_SIZE * side, True
    lo, hi = 0.5 + MOVE_SPAN / 2, 0.5 - MOVE_SPAN / 2  # start / end fractions for "left" and "up"
    if motion == "moves to the left":
        cx = w * (lo + (hi - lo) * progress)
    elif motion == "moves to the right":
        cx = w * (hi + (lo - hi) * progress)
    elif motion == "moves up":
        cy = h * (lo + (hi - lo) * progress)
    elif motion == "moves down":
        cy = h * (hi + (lo - hi) * progress)
    elif motion == "grows":
        size = side * (0.3 + 0.5 * progress)
    elif motion == "shrinks":
        size = side * (0.8 - 0.5 * progress)
    elif motion == "blinks":
        visible = math.cos(2.0 * math.pi * (t - t_mid) / BLINK_PERIOD) >= 0.0
    elif motion != "stays still":
        raise ValueError(f"unknown motion {motion!r}")
    return cx, cy, size, visible


def _in_lane(lane: int, cx: float, cy: float, size: float, w: int, h: int) -> tuple[float, float, float]:
    """A full-frame placement moved into `lane` (scaled about the frame centre); lane -1 unchanged."""
    if lane < 0:
        return cx, cy, size
    ax, ay = LANE_CENTRES[lane]
    return ax * w + LANE_SCALE * (cx - w / 2.0), ay * h + LANE_SCALE * (cy - h / 2.0), LANE_SCALE * size


def render_frames(script: VideoScript, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, H, W, 3]: noisy grey background, every active event's shape drawn over it
    (in script order; a later shape covers an earlier one where they meet)."""
    n, h, w = script.num_frames, script.height, script.width
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    active: list[list[int]] = [[] for _ in range(n)]
    for i, ev in enumerate(script.events):
        for f in range(ev.start_frame, ev.end_frame):
            active[f].append(i)
    frames = np.empty((n, h, w, 3), dtype=np.uint8)
    bg = np.asarray(BACKGROUND_RGB, dtype=np.float32)
    for f in range(n):
        img = bg + rng.normal(0.0, BACKGROUND_NOISE, size=(h, w, 3)).astype(np.float32)
        base = img.copy()  # background + noise: every shape's pixels are its colour + this noise
        for i in active[f]:
            ev = script.events[i]
            length = ev.end_frame - ev.start_frame
            progress = (f - ev.start_frame + 0.5) / length
            t, t_mid = (f + 0.5) / script.fps, (ev.start_frame + ev.end_frame) / (2.0 * script.fps)
            cx, cy, size, visible = _placement(ev.motion, progress, t, t_mid, w, h)
            if visible:
                mask = _shape_mask(ev.shape, xx, yy, *_in_lane(ev.lane, cx, cy, size, w, h))
                img[mask] = base[mask] + (np.asarray(COLOUR_RGB[ev.colour], dtype=np.float32) - bg)
        frames[f] = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return frames


# --------------------------------------------------------------------------- audio


def _sound(sound: str, num: int, sr: int, rng: np.random.Generator) -> np.ndarray:
    """float64 [num]: the waveform of `sound` starting at phase 0."""
    t = np.arange(num, dtype=np.float64) / sr
    if sound in TONE_HZ:
        return TONE_AMPLITUDE * np.sin(2.0 * np.pi * TONE_HZ[sound] * t)
    if sound == "pulsing beeps":
        gate = (np.mod(t, PULSE_PERIOD) < PULSE_PERIOD / 2).astype(np.float64)
        return TONE_AMPLITUDE * gate * np.sin(2.0 * np.pi * PULSE_HZ * t)
    if sound in CHIRP_RANGE:  # exponential sweep f0 -> f1 repeated every CHIRP_PERIOD
        f0, f1 = CHIRP_RANGE[sound]
        tau = np.mod(t, CHIRP_PERIOD)
        k = math.log(f1 / f0) / CHIRP_PERIOD
        phase = 2.0 * np.pi * f0 * (np.expm1(k * tau) / k)
        return TONE_AMPLITUDE * np.sin(phase) * _fade(num, sr, period=CHIRP_PERIOD)
    if sound == "white noise":
        return np.clip(rng.normal(0.0, NOISE_STD, size=num), -0.9, 0.9)
    if sound == "silence":
        return np.zeros(num)
    raise ValueError(f"unknown sound {sound!r}")


def _fade(num: int, sr: int, period: float | None = None) -> np.ndarray:
    """Raised-cosine fade in/out of FADE_SECONDS at the ends (or at every `period`)."""
    edge = max(1, int(FADE_SECONDS * sr))
    if period is None:
        env = np.ones(num)
        ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(min(edge, num // 2)) / edge)
        env[: ramp.size] = ramp
        env[num - ramp.size :] = np.minimum(env[num - ramp.size :], ramp[::-1])
        return env
    pos = np.mod(np.arange(num), int(round(period * sr)))
    span = int(round(period * sr))
    dist = np.minimum(pos, span - 1 - pos)
    return np.where(dist < edge, 0.5 - 0.5 * np.cos(np.pi * dist / edge), 1.0)


def render_audio(script: VideoScript, rng: np.random.Generator) -> np.ndarray:
    """float32 [S] mono waveform: quiet noise, each event's sound over its exact interval, then
    each distractor's (concurrent sounds add)."""
    sr = script.sample_rate
    audio = rng.normal(0.0, BACKGROUND_AUDIO_STD, size=script.num_samples)
    for ev in (*script.events, *script.distractors):
        a, b = script.sample_index(ev.start_frame), script.sample_index(ev.end_frame)
        audio[a:b] += _sound(ev.sound, b - a, sr, rng) * _fade(b - a, sr)
    return np.clip(audio, -1.0, 1.0).astype(np.float32)


# --------------------------------------------------------------------------- mp4


def rgb_to_yuv420p(rgb: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] RGB -> uint8 [H * 3 / 2, W] yuv420p (PyAV's plane layout: Y, then U, then V),
    BT.601 limited range in integer arithmetic, chroma from each 2x2 block's mean (libswscale's
    luma within one level; its chroma filter differs at shape edges).

    The encoder is handed these planes rather than RGB: with libswscale converting inside the
    encoder, the same frames sometimes gave another bitstream (one or two of the default's 144
    videos in 5 of 7 corpus runs on one box), so the corpus was not byte-reproducible.

    >>> rgb_to_yuv420p(np.zeros((2, 2, 3), np.uint8)).ravel().tolist()  # black: Y 16, U = V = 128
    [16, 16, 16, 16, 128, 128]
    >>> rgb_to_yuv420p(np.zeros((6, 4, 3), np.uint8)).shape
    (9, 4)
    """
    x = rgb.astype(np.int32)
    h, w = x.shape[:2]
    y = ((66 * x[..., 0] + 129 * x[..., 1] + 25 * x[..., 2] + 128) >> 8) + 16
    q = x.reshape(h // 2, 2, w // 2, 2, 3).sum(axis=(1, 3))  # 4x each 2x2 block's mean
    u = ((-38 * q[..., 0] - 74 * q[..., 1] + 112 * q[..., 2] + 512) >> 10) + 128
    v = ((112 * q[..., 0] - 94 * q[..., 1] - 18 * q[..., 2] + 512) >> 10) + 128
    return np.concatenate([y.ravel(), u.ravel(), v.ravel()]).reshape(h * 3 // 2, w).astype(np.uint8)


# libx264's C code only: its SIMD paths are chosen by the CPU (AVX2 and AVX-512 gave other bytes
# for 95 of the default's 144 videos), and with them one encode in ~250 came out as another
# bitstream from the same frames in one process (docs/benchmarks.md, Determinism); the C code gave
# the same bytes in every run, under valgrind's emulated CPU too, at ~2x the encoding time
X264_PARAMS = "asm=0"


def write_mp4(path: str | Path, frames: np.ndarray, audio: np.ndarray, fps: int, sample_rate: int, crf: int = 12) -> None:
    """Encode uint8 [N, H, W, 3] frames (H.264, yuv420p) and float32 [S] mono audio (AAC) into `path`.

    Frames go to libx264 already in yuv420p (`rgb_to_yuv420p`), which runs single-threaded with
    fixed options and without its assembly (`X264_PARAMS`). Packets are muxed in time order (one
    video frame, then the audio up to the end of that frame).
    """
    n, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"yuv420p needs even frame sizes, got {w}x{h}")
    with av.open(str(path), mode="w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=Fraction(fps))
        vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
        vs.codec_context.thread_count = 1
        vs.options = {"crf": str(crf), "preset": "veryfast", "threads": "1", "g": str(2 * fps), "bf": "0",
                      "x264-params": X264_PARAMS}
        aus = out.add_stream("aac", rate=sample_rate)
        aus.layout = "mono"
        aus.codec_context.thread_count = 1
        aus.options = {"aac_coder": "fast"}
        chunk = 1024
        sent = 0  # audio samples handed to the encoder so far
        for f in range(n):
            vf = av.VideoFrame.from_ndarray(rgb_to_yuv420p(frames[f]), format="yuv420p")
            vf.pts = f
            vf.time_base = Fraction(1, fps)
            out.mux(vs.encode(vf))
            target = len(audio) if f == n - 1 else int(round((f + 1) * sample_rate / fps))
            while sent + chunk <= target or (f == n - 1 and sent < target):
                piece = audio[sent : min(sent + chunk, target)]
                af = av.AudioFrame.from_ndarray(piece[None, :], format="fltp", layout="mono")
                af.sample_rate, af.pts, af.time_base = sample_rate, sent, Fraction(1, sample_rate)
                out.mux(aus.encode(af))
                sent += piece.size
        out.mux(vs.encode(None))
        out.mux(aus.encode(None))
