"""The released PadCaptioner-3B's media preparation: frames and audio prepared exactly as its test path does.

Pure python + torch, no ray. What the release (showlab/PadCaptioner @ da150ad, video-SALMONN 2+ base)
feeds its vision tower and Whisper encoder, re-implemented from docs/design/release.md §2, §4.1-4.3
(citations there: `D` = qwenvl/data/dataset.py, `P` = its vendored Qwen2VLImageProcessorFast):

    inputs = read_release_inputs("a.mp4", MediaConfig())
    inputs.pixel_values()          # float32 [T*gh*gw, 1176], the processor's patch layout
    inputs.grid_thw                # (T, gh, gw) in 14-px patches (the release's video_grid_thw)
    inputs.mel                     # float32 [C, 128, 3000] Whisper log-mel per 30 s chunk, or None
    inputs.audio_counts            # a_t: <|audio_pad|> tokens after segment t (sum = A_total)
    index_sets(inputs.layout_grid) # pipeline/release/layout.py: per-timestep video / audio token indices

Frames (D:563-603). L = num_frames / average_fps of the stream's metadata; n = min(max(round(L / 0.5),
64), 256) with Python's round (half to even); indices np.unique(np.linspace(0, N-1, n, dtype=int));
fps = len(indices) / L; per-frame pixel budget 61250, scaled to 0.95 * 256 / len(indices) * 61250 when fewer
than 256 frames were kept (so 255 frames get less than 256 do); min 784. `smart_resize` (factor 28), then a
BICUBIC antialiased resize of the uint8 frames, the CLIP mean/std rescale+normalise fused in float32
((x - 255 mean) / (255 std)), an odd frame count padded by repeating the last frame, and the patchify
permute(0, 3, 6, 4, 7, 2, 1, 5, 8) -> [T*gh*gw, 3*2*14*14]. Seconds per timestep d = 2 / fps.

Resize. The release calls torchvision v2 `F.resize(..., BICUBIC)` (antialias on by default) on uint8 CPU
tensors. On CPU that function hands uint8 straight to `torch.nn.functional.interpolate(mode="bicubic",
antialias=True, align_corners=False)` (torchvision 0.28 `_do_native_uint8_resize_on_cpu`), which is what
`resize_frames` calls, so torchvision is not needed for pixel parity. (torchvision cannot be installed
here anyway: the only 0.28.0 wheel for torch 2.13 is the CUDA build, whose ops fail to register on CPU
torch.) Do not move frames to a GPU before resizing: torchvision's GPU path goes through float32 and
differs by 1 grey level on ~10% of pixels.

Decoding. The release's primary reader is torchcodec 0.4 (`VideoDecoder` / `AudioDecoder`), which is
not available to this project; frames come from decord (the reader preprocess/media.py uses), indexed
by the same rule, with num_frames and average_fps computed as torchcodec 0.4 computes them after its
scan (`scan_metadata`: packet count, and count / content duration, so L is the stream's content
duration). decord's YUV->RGB conversion may differ slightly from torchcodec's. Audio comes from
PyAV with FFmpeg's swresample doing the resample to 16 kHz and the downmix to mono (as torchcodec does
with FFmpeg; preprocess/media.py instead averages channels), the whole stream from its own start, not
aligned or trimmed to the video timeline (D:483-522).

Audio (D:483-522, docs/design/release.md §4.2). Shorter than 1 s -> zero-padded to 1 s; cut into 30 s pieces; each
piece through WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
chunk_length=30) with its default max-length padding -> [128, 3000]; A_total = 60 * ceil(samples / 480000).
A file without an audio stream (or whose audio cannot be decoded: the release's `process_audio` returns
None on any error) gets no audio tokens at all.

Interleave counts a_t and per-timestep index sets come from pipeline/release/layout.py (`audio_counts`,
`index_sets`, docs/design/release.md §2 and §4.3), given this media preparation's grid, d and A_total (`av_grid`).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.release.geometry import CHUNK_SECONDS as WHISPER_SECONDS
from pipeline.release.geometry import RELEASE, Geometry
from pipeline.release.layout import AVGrid, audio_counts, av_grid
from preprocess.media import METADATA_ERRORS, MediaError, _first_line, open_media, probe_video

# patch / temporal patch / merge sizes, tokens per second and the audio window are the checkpoint's
# (pipeline/release/geometry.py: MediaConfig.geometry, the 3B's by default)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESCALE = 1 / 255
SAMPLE_RATE = 16000
CHUNK_SECONDS = int(WHISPER_SECONDS)
CHUNK_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000
N_MELS = 128


class FrontendError(ValueError):
    """A video cannot be prepared the release's way; the message says why."""


@dataclass(frozen=True)
class MediaConfig:
    """The release's test-time media settings (scripts_run/test.sh): 64-256 frames at 0.5 s, 61250 / 784 px."""

    seconds_per_frame: float = 0.5  # base_interval
    min_frames: int = 64  # video_min_frames
    max_frames: int = 256  # video_max_frames
    max_frame_pixels: float = 61250  # video_max_frame_pixels
    min_frame_pixels: float = 784  # video_min_frame_pixels
    geometry: Geometry = RELEASE  # the checkpoint's patch / merge / temporal sizes, token rates

    @classmethod
    def from_features(cls, features: Any) -> MediaConfig:
        """From pipeline.config.FeaturesConfig (its frame-count fields and the release pixel budgets); the
        geometry from the config.json of `features.release_path` when that is a release directory."""
        from pipeline.release.checkpoint import is_release_dir

        path = features.release_path
        geometry = Geometry.from_dir(path) if path and is_release_dir(path) else RELEASE
        return cls(seconds_per_frame=float(features.seconds_per_frame), min_frames=int(features.min_frames),
                   max_frames=int(features.max_frames), max_frame_pixels=float(features.release_max_frame_pixels),
                   min_frame_pixels=float(features.release_min_frame_pixels), geometry=geometry)


# --------------------------------------------------------------------------- frames


def frame_count(length_s: float, cfg: MediaConfig) -> int:
    """n = min(max(round(L / seconds_per_frame), min_frames), max_frames); Python round (half to even)."""
    return min(max(round(length_s / cfg.seconds_per_frame), cfg.min_frames), cfg.max_frames)


def sample_indices(num_frames: int, average_fps: float, cfg: MediaConfig) -> tuple[np.ndarray, float]:
    """(frame indices, L): np.unique(np.linspace(0, N - 1, n, dtype=int)) with L = N / average_fps."""
    if num_frames < 1 or not (math.isfinite(average_fps) and average_fps > 0):
        raise FrontendError(f"the video stream reports {num_frames} frames at {average_fps} fps")
    length = num_frames / average_fps
    idx = np.unique(np.linspace(0, num_frames - 1, frame_count(length, cfg), dtype=int))
    return idx, length


def pixel_budget(kept_frames: int, cfg: MediaConfig) -> tuple[float, float]:
    """(max_pixels, min_pixels) per frame: max scaled by 0.95 * max_frames / kept when kept < max_frames."""
    top = cfg.max_frame_pixels
    if kept_frames < cfg.max_frames:
        top = 0.95 * cfg.max_frames / kept_frames * top
    return top, cfg.min_frame_pixels


def smart_resize(height: int, width: int, factor: int = RELEASE.factor, min_pixels: float = 56 * 56,
                 max_pixels: float = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of `factor`, area in [min, max], aspect kept.

    round (half to even) to the factor; if over max_pixels, scale down by sqrt(area / max) and floor
    (never below one factor, as transformers 5.24's rule; 4.51's may lack that floor, which only matters
    for aspect ratios over ~80:1); if under min_pixels, scale up and ceil.
    """
    if min(height, width) < 1:
        raise FrontendError(f"frame size {height}x{width} is empty")
    if max(height, width) / min(height, width) > 200:
        raise FrontendError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over 200 (frame {height}x{width})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [N, 3, H, W] (CPU) -> uint8 [N, 3, height, width]: bicubic, antialiased, native uint8 (module doc)."""
    if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[1] != 3:
        raise FrontendError(f"frames must be uint8 [N, 3, H, W], got {frames.dtype} {list(frames.shape)}")
    if tuple(frames.shape[-2:]) == (height, width):
        return frames  # torchvision returns the input unchanged at the same size
    return F.interpolate(frames.cpu().contiguous(), size=[height, width], mode="bicubic", align_corners=False,
                         antialias=True)


def normalize(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> float32: (x - mean/RESCALE) / (std/RESCALE), the processor's fused rescale+normalise."""
    mean = (torch.tensor(CLIP_MEAN) * (1.0 / RESCALE)).view(1, 3, 1, 1)
    std = (torch.tensor(CLIP_STD) * (1.0 / RESCALE)).view(1, 3, 1, 1)
    return (frames.to(torch.float32) - mean) / std


def pad_temporal(frames: torch.Tensor, geo: Geometry = RELEASE) -> torch.Tensor:
    """[N, ...] -> [N rounded up to the temporal patch, ...], repeating the last frame."""
    extra = (-frames.shape[0]) % geo.temporal_patch_size
    if extra == 0:
        return frames
    return torch.cat([frames, frames[-1:].expand(extra, *frames.shape[1:])])


def patchify(frames: torch.Tensor, geo: Geometry = RELEASE) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[N, C, H, W] (N a multiple of the temporal patch tp, H, W of the factor p*m) -> ([T*gh*gw, C*tp*p*p],
    (T, gh, gw)), the processor's order (3B: tp 2, p 14, m 2).

    Rows run over timesteps, then m x m merge windows in raster order, then the patches of a window;
    a row holds channel, then temporal frame, then the p x p pixels.
    """
    n, c, h, w = frames.shape
    tp, p, m = geo.temporal_patch_size, geo.patch_size, geo.spatial_merge_size
    if n % tp or h % geo.factor or w % geo.factor:
        raise FrontendError(f"cannot patchify {list(frames.shape)}: frames must be a multiple of {tp}, sides "
                            f"multiples of {geo.factor}")
    t, gh, gw = n // tp, h // p, w // p
    x = frames.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * tp * p * p), (t, gh, gw)


def timestep_seconds(kept_frames: int, length_s: float, geo: Geometry = RELEASE) -> float:
    """d = second_per_grid_ts = temporal_patch / fps with fps = kept frames / L."""
    return geo.temporal_patch_size / (kept_frames / length_s)


# --------------------------------------------------------------------------- audio


def audio_token_total(samples: int, geo: Geometry = RELEASE) -> int:
    """A_total = tokens per chunk (60 for the 3B) * ceil(samples / 480000), samples after the 1 s zero-pad."""
    return geo.audio_tokens_per_chunk * math.ceil(max(samples, SAMPLE_RATE) / CHUNK_SAMPLES)


def whisper_extractor():
    """The release's WhisperFeatureExtractor settings (TR:558-563), built without any files."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=N_MELS, sampling_rate=SAMPLE_RATE, hop_length=160,
                                   chunk_length=CHUNK_SECONDS)


def mel_chunks(waveform: np.ndarray, extractor=None) -> tuple[np.ndarray, int]:
    """16 kHz mono float32 [S] -> (float32 [C, 128, 3000] log-mel per 30 s piece, samples after padding)."""
    audio = np.asarray(waveform, dtype=np.float32).reshape(-1)
    if not np.isfinite(audio).all():
        raise FrontendError("the audio decodes to NaN/inf samples")
    if audio.shape[0] < SAMPLE_RATE:
        audio = np.pad(audio, (0, SAMPLE_RATE - audio.shape[0]))
    extractor = extractor or whisper_extractor()
    pieces = [audio[k:k + CHUNK_SAMPLES] for k in range(0, audio.shape[0], CHUNK_SAMPLES)]
    mels = [np.asarray(extractor(p, sampling_rate=SAMPLE_RATE, return_tensors="np")["input_features"][0], np.float32)
            for p in pieces]  # one call per piece, as the release does
    return np.stack(mels), int(audio.shape[0])


# --------------------------------------------------------------------------- one video


@dataclass
class ReleaseInputs:
    """One video prepared the release's way (module doc); frames kept as resized uint8 (4x smaller than pixels)."""

    frames: torch.Tensor  # uint8 [N, 3, h, w] resized, not padded (N = kept frames)
    length_s: float  # L = num_frames / average_fps
    seconds_per_timestep: float  # d
    grid_thw: tuple[int, int, int]  # (T, gh, gw) in 14-px patches
    mel: np.ndarray | None  # float32 [C, 128, 3000], None without audio
    audio_total: int  # A_total; 0 without audio
    geometry: Geometry = RELEASE  # the checkpoint's (MediaConfig.geometry)

    @property
    def num_timesteps(self) -> int:
        return self.grid_thw[0]

    @property
    def tokens_per_timestep(self) -> int:
        """V = (gh / m) * (gw / m) merged tokens per timestep."""
        return self.layout_grid.per_step

    @property
    def has_audio(self) -> bool:
        return self.mel is not None

    @property
    def layout_grid(self) -> AVGrid:
        return av_grid(self.grid_thw, self.seconds_per_timestep, self.audio_total, self.geometry)

    @property
    def audio_counts(self) -> list[int]:
        """a_t: audio tokens after segment t (sum = audio_total)."""
        return audio_counts(self.layout_grid)

    def to_bytes(self) -> bytes:
        """A compact serialisation (uint8 frames, float32 mel, the numbers) to ship between processes."""
        numbers = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("frames", "mel")}  # in field order
        numbers["geometry"] = asdict(self.geometry)
        arrays = {"frames": self.frames.numpy(), "numbers": np.frombuffer(json.dumps(numbers).encode("utf-8"), dtype=np.uint8)}
        if self.mel is not None:
            arrays["mel"] = self.mel
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> ReleaseInputs:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            n = json.loads(z["numbers"].tobytes().decode("utf-8"))
            n.update(grid_thw=tuple(n["grid_thw"]), geometry=Geometry(**(n.get("geometry") or {})))
            return cls(frames=torch.from_numpy(z["frames"]), mel=z["mel"] if "mel" in z.files else None, **n)

    def pixel_values(self) -> torch.Tensor:
        """float32 [T*gh*gw, patch_dim (1176)]: normalised, padded to whole temporal patches, patchified."""
        return patchify(pad_temporal(normalize(self.frames), self.geometry), self.geometry)[0]

    def segment_times(self) -> np.ndarray:
        """float32 [T, 2]: [t*d, (t+1)*d], the last end clipped to L (an odd frame count overshoots it)."""
        t = np.arange(self.num_timesteps, dtype=np.float64)
        ends = np.minimum((t + 1) * self.seconds_per_timestep, self.length_s)
        return np.stack([t * self.seconds_per_timestep, ends], axis=1).astype(np.float32)


def prepare_frames(frames: np.ndarray | torch.Tensor, kept: int, length_s: float,
                   cfg: MediaConfig) -> tuple[torch.Tensor, tuple[int, int, int], float]:
    """Sampled uint8 frames [N, H, W, 3] -> (resized uint8 [N, 3, h, w], grid (T, gh, gw), d)."""
    x = torch.as_tensor(np.ascontiguousarray(frames)) if isinstance(frames, np.ndarray) else frames
    if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[-1] != 3:
        raise FrontendError(f"frames must be uint8 [N, H, W, 3], got {x.dtype} {list(x.shape)}")
    geo = cfg.geometry
    top, bottom = pixel_budget(kept, cfg)
    h, w = smart_resize(int(x.shape[1]), int(x.shape[2]), geo.factor, bottom, top)
    resized = resize_frames(x.permute(0, 3, 1, 2).contiguous(), h, w)
    grid = (-(-kept // geo.temporal_patch_size), h // geo.patch_size, w // geo.patch_size)
    return resized, grid, timestep_seconds(kept, length_s, geo)


def build_inputs(frames: np.ndarray | torch.Tensor, frame_indices: np.ndarray, num_source_frames: int,
                 average_fps: float, waveform: np.ndarray | None, cfg: MediaConfig,
                 extractor=None) -> ReleaseInputs:
    """Sampled frames (by `sample_indices`) + 16 kHz mono audio (or None) -> ReleaseInputs."""
    length = num_source_frames / average_fps
    kept = len(frame_indices)
    if kept < 1 or len(frames) != kept:
        raise FrontendError(f"{len(frames)} frames for {kept} sampled indices")
    resized, grid, d = prepare_frames(frames, kept, length, cfg)
    mel, total = None, 0
    if waveform is not None:
        mel, samples = mel_chunks(waveform, extractor)
        total = audio_token_total(samples, cfg.geometry)
    return ReleaseInputs(frames=resized, length_s=length, seconds_per_timestep=d, grid_thw=grid, mel=mel, audio_total=total,
                         geometry=cfg.geometry)


# --------------------------------------------------------------------------- reading files


def scan_metadata(path: str) -> tuple[int, float] | None:
    """(num_frames, average_fps) as torchcodec 0.4 reports them after its scan (seek_mode "exact", the default).

    torchcodec counts the video stream's packets (discarded ones skipped) and takes
    average_fps = num_frames / (max(pts + duration) - min(pts)), pts falling back to dts; the
    release's L = num_frames / average_fps is then the stream's content duration. Demuxing only, no
    decoding. None when the stream has no timed packets (the caller falls back to decord's numbers).
    """
    import av

    count, lo, hi = 0, math.inf, -math.inf
    with av.open(path, metadata_errors=METADATA_ERRORS) as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            stamp = packet.pts if packet.pts is not None else packet.dts
            if stamp is None or packet.is_discard:  # the demuxer's final empty packet has neither
                continue
            count += 1
            lo = min(lo, stamp)
            hi = max(hi, stamp + packet.duration)
        base = float(stream.time_base) if stream.time_base else 0.0
    if count == 0 or hi <= lo or base <= 0:
        return None
    return count, count / ((hi - lo) * base)


def read_frames(path: str, uri: str, cfg: MediaConfig, threads: int = 0) -> tuple[np.ndarray, np.ndarray, int, float]:
    """decord at source resolution: -> (uint8 [n, H, W, 3] RGB, indices, num_frames, average_fps).

    num_frames / average_fps are torchcodec's (`scan_metadata`), decord's frame count and header fps
    when the scan finds no timed packets. Indices past decord's own count (a file whose packets and
    decodable frames disagree) are clipped to its last frame.
    """
    import decord

    try:
        vr = decord.VideoReader(path, num_threads=threads)
        count, fps = len(vr), float(vr.get_avg_fps())
    except Exception as e:  # decord raises DECORDError / RuntimeError / AssertionError
        raise MediaError(f"video stream cannot be opened by decord ({_first_line(e)}): {uri}", "undecodable") from e
    scanned = scan_metadata(path)
    num_frames, average_fps = scanned if scanned is not None else (count, fps)
    idx, _ = sample_indices(num_frames, average_fps, cfg)  # its FrontendError: read_release_inputs words it
    try:
        frames = vr.get_batch(np.minimum(idx, count - 1).tolist()).asnumpy()
    except Exception as e:
        raise MediaError(f"video frames cannot be decoded ({_first_line(e)}): {uri}", "undecodable") from e
    return frames, idx, num_frames, average_fps


def read_audio(path: str) -> np.ndarray | None:
    """PyAV: the first audio stream, whole, resampled by FFmpeg to 16 kHz mono float32; None if absent or undecodable.

    As torchcodec 0.4's `get_all_samples` (= samples played in [0, end)): samples the stream times
    before 0 (encoder priming under an edit list) are dropped; nothing else is aligned or trimmed.
    None on a decoding error too, as the release's process_audio returns None on any error (the video is
    then captioned without audio tokens).
    """
    import av

    pieces: list[np.ndarray] = []
    first: float | None = None
    try:
        with av.open(path, metadata_errors=METADATA_ERRORS) as container:
            if not container.streams.audio:
                return None
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(container.streams.audio[0]):
                if first is None:
                    first = float(frame.time) if frame.time is not None else 0.0
                pieces.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(frame))
            pieces.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    except (av.error.FFmpegError, ValueError):
        return None
    if not pieces:
        return None
    audio = np.concatenate(pieces).astype(np.float32)
    if first is not None and first < 0:
        audio = audio[round(-first * SAMPLE_RATE):]
    return audio if audio.size and np.isfinite(audio).all() else None


def read_release_inputs(uri: str, cfg: MediaConfig, storage_options: dict[str, Any] | None = None,
                        max_bytes: int = 0, threads: int = 0, extractor=None) -> ReleaseInputs:
    """A video file or fsspec URI -> ReleaseInputs. Raises preprocess.media.MediaError for unusable files."""
    try:
        with open_media(uri, storage_options, max_bytes) as path:
            probe = probe_video(path, uri)
            frames, idx, count, fps = read_frames(path, uri, cfg, threads)
            waveform = read_audio(path) if probe.has_audio else None
        return build_inputs(frames, idx, count, fps, waveform, cfg, extractor)
    except FrontendError as e:  # sample_indices' or build_inputs' refusal
        raise MediaError(f"{e}: {uri}", "undecodable") from e
