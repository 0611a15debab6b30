"""The synthetic corpus: real mp4s whose decoded pixels and sound match the annotations.

    .venv/bin/python -m pytest tests/test_synthetic.py -q
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import av
import decord
import numpy as np
import pytest

from pipeline.config import SyntheticConfig
from preprocess import synthetic as syn
from preprocess import synthetic_media as media

CFG = SyntheticConfig(num_videos=4, seed=0, min_duration=20.0, max_duration=30.0, min_events=2, max_events=6,
                      test_fraction=0.25, width=96, height=96, fps=8, num_workers=2)
BG = np.asarray(media.BACKGROUND_RGB, dtype=np.float64)


# --------------------------------------------------------------------------- decoding helpers


def decode_audio(path: str) -> tuple[np.ndarray, int]:
    """All audio of `path` as float32 mono [S] via PyAV, and its sample rate."""
    with av.open(path) as c:
        stream = c.streams.audio[0]
        chunks = [f.to_ndarray().reshape(-1) for f in c.decode(stream)]
        return np.concatenate(chunks).astype(np.float32), stream.codec_context.sample_rate


def decode_frames(path: str) -> np.ndarray:
    vr = decord.VideoReader(path)
    return vr.get_batch(list(range(len(vr)))).asnumpy()


def pooled_colour(frame: np.ndarray) -> str | None:
    """The palette colour explaining the mean of a 32x32 downsample, or None for background.

    mean = bg * (1 - a) + c * a for the shape's area fraction a: fit a per colour, keep
    the colour with the smallest residual (only pooled features, no pixel masks).
    """
    h, w, _ = frame.shape
    small = frame.reshape(32, h // 32, 32, w // 32, 3).mean(axis=(1, 3))
    delta = small.reshape(-1, 3).mean(0) - BG
    if np.linalg.norm(delta) < 4.0:
        return None
    best, best_res = None, np.inf
    for name, rgb in media.COLOUR_RGB.items():
        d = np.asarray(rgb, dtype=np.float64) - BG
        a = float(np.clip(delta @ d / (d @ d), 0.02, 1.0))
        res = float(np.linalg.norm(delta - a * d))
        if res < best_res:
            best, best_res = name, res
    return best


def shape_pixels(frame: np.ndarray) -> np.ndarray:
    """Pixels far from the background grey: [M, 3]."""
    flat = frame.reshape(-1, 3).astype(np.float64)
    return flat[np.abs(flat - BG).max(axis=1) > 60]


def nearest_colour(rgb: np.ndarray) -> str:
    return min(media.COLOUR_RGB, key=lambda n: np.linalg.norm(rgb - np.asarray(media.COLOUR_RGB[n])))


def _peak_track(x: np.ndarray, sr: int) -> np.ndarray:
    """Dominant frequency (Hz) of 32 ms frames, hop 16 ms."""
    win, hop, nfft = int(0.032 * sr), int(0.016 * sr), 8192
    out = []
    for s in range(0, len(x) - win, hop):
        spec = np.abs(np.fft.rfft(x[s : s + win] * np.hanning(win), nfft))
        out.append(np.argmax(spec) * sr / nfft)
    return np.asarray(out)


def classify_sound(x: np.ndarray, sr: int) -> str:
    """Which of the 8 synthetic sounds a 0.5 s window holds (independent of the generator's code)."""
    if np.sqrt(np.mean(x**2)) < 0.02:
        return "silence"
    power = np.abs(np.fft.rfft(x * np.hanning(len(x)))) ** 2
    freqs = np.fft.rfftfreq(len(x), 1.0 / sr)
    peak = freqs[np.argmax(power)]
    concentration = power[np.abs(freqs - peak) < 60].sum() / power.sum()
    if concentration > 0.7:  # a steady pitch: a tone or gated tone
        blocks = x[: len(x) // 200 * 200].reshape(-1, 200)
        env = np.sqrt((blocks**2).mean(axis=1))
        if env.min() < 0.2 * env.max():
            return f"pulsing beeps@{peak:.0f}"
        return f"tone@{peak:.0f}"
    band = lambda lo, hi: power[(freqs >= lo) & (freqs <= hi)].sum() / power.sum()  # noqa: E731
    if band(350, 1450) > 0.8 or band(1450, 3600) > 0.8:
        d = np.diff(_peak_track(x, sr))
        d = d[np.abs(d) < 400]  # drop the jumps where a sweep restarts
        direction = "rising" if (d > 0).sum() > 2 * (d < 0).sum() else "falling" if (d < 0).sum() > 2 * (d > 0).sum() else "?"
        low_band = band(350, 1450) > 0.8
        return f"{direction} chirp" + ("" if (direction == "rising") == low_band else " (wrong band)")
    return "white noise"


def expected_sound_label(sound: str) -> str:
    if sound in media.TONE_HZ:
        return "tone"
    if sound == "pulsing beeps":
        return "pulsing beeps"
    return sound


def check_sound(x: np.ndarray, sr: int, sound: str) -> None:
    label = classify_sound(x, sr)
    name, _, hz = label.partition("@")
    assert name == expected_sound_label(sound), (sound, label)
    if hz:
        target = media.TONE_HZ.get(sound, media.PULSE_HZ)
        assert abs(float(hz) - target) < 0.03 * target, (sound, label)


def window(audio: np.ndarray, sr: int, centre: float, half: float = 0.25) -> np.ndarray:
    return audio[int(round((centre - half) * sr)) : int(round((centre + half) * sr))]


def gaps(duration: float, stamps: list[list[float]]) -> list[tuple[float, float]]:
    edges = [0.0] + [t for s in stamps for t in s] + [duration]
    return [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> syn.CorpusInfo:
    return syn.generate_corpus(tmp_path_factory.mktemp("synth_a"), CFG, progress=False)


@pytest.fixture(scope="module")
def manifest(corpus) -> dict:
    return json.loads(Path(corpus.manifest).read_text())


def _load_longvale(corpus) -> dict:
    out = {}
    for split, path in corpus.longvale.items():
        for vid, rec in json.loads(Path(path).read_text()).items():
            out[vid] = dict(rec, split=split)
    return out


# --------------------------------------------------------------------------- tests


def test_files_and_splits(corpus):
    assert len(corpus.videos) == corpus.num_videos == 4 and (corpus.num_train, corpus.num_test) == (3, 1)
    assert len(corpus.splits["test"]) == 1 and len(corpus.splits["train"]) == 3
    for path in list(corpus.videos.values()) + list(corpus.longvale.values()) + list(corpus.chronusav.values()):
        assert Path(path).is_file() and Path(path).stat().st_size > 0
    lv = _load_longvale(corpus)
    assert sorted(lv) == sorted(corpus.videos)
    for vid, rec in lv.items():
        assert CFG.min_duration - 0.2 <= rec["duration"] <= CFG.max_duration + 0.2
        assert CFG.min_events <= len(rec["timestamps"]) <= CFG.max_events
        assert rec["split"] == ("test" if vid in corpus.splits["test"] else "train")


def test_media_matches_annotations(corpus):
    for vid, rec in _load_longvale(corpus).items():
        path = corpus.videos[vid]
        vr = decord.VideoReader(path)
        assert vr.get_avg_fps() == pytest.approx(CFG.fps)
        assert len(vr) == round(rec["duration"] * CFG.fps)
        assert vr[0].shape == (CFG.height, CFG.width, 3)
        audio, sr = decode_audio(path)
        expected = round(rec["duration"] * sr)
        assert sr == CFG.sample_rate
        assert expected <= len(audio) <= expected + 1024  # AAC pads the last 1024-sample frame
        dec = decord.AudioReader(path, sample_rate=sr, mono=True)
        assert abs(dec.shape[1] - expected) <= 1024
        for s, e in rec["timestamps"]:  # snapped to frame boundaries
            assert s * CFG.fps == pytest.approx(round(s * CFG.fps)) and e * CFG.fps == pytest.approx(round(e * CFG.fps))


def test_event_midpoints_show_colour_and_sound_gaps_show_nothing(corpus, manifest):
    checked = 0
    for video in manifest["videos"]:
        path = corpus.videos[video["id"]]
        frames = decode_frames(path)
        audio, sr = decode_audio(path)
        for ev in video["events"]:
            mid = (ev["start"] + ev["end"]) / 2
            frame = frames[int(mid * CFG.fps)]
            assert nearest_colour(shape_pixels(frame).mean(0)) == ev["colour"], (video["id"], ev)
            assert pooled_colour(frame) == ev["colour"], (video["id"], ev)
            check_sound(window(audio, sr, mid), sr, ev["sound"])
            checked += 1
        stamps = [[e["start"], e["end"]] for e in video["events"]]
        for g0, g1 in gaps(video["duration"], stamps):
            frame = frames[int((g0 + g1) / 2 * CFG.fps)]
            assert pooled_colour(frame) is None and len(shape_pixels(frame)) == 0
            assert np.abs(frame.reshape(-1, 3).mean(0) - BG).max() < 4
            assert np.sqrt(np.mean(window(audio, sr, (g0 + g1) / 2, 0.2) ** 2)) < 0.005
    assert checked >= 8


def test_event_bounds_are_exact_to_the_frame(corpus, manifest):
    for video in manifest["videos"]:
        path = corpus.videos[video["id"]]
        frames = decode_frames(path)
        audio, sr = decode_audio(path)
        for ev in video["events"]:
            a, b = ev["start_frame"], ev["end_frame"]
            assert len(shape_pixels(frames[a - 1])) == 0 and len(shape_pixels(frames[b])) == 0
            if ev["motion"] != "blinks":
                assert len(shape_pixels(frames[a])) > 100 and len(shape_pixels(frames[b - 1])) > 100
            if ev["sound"] != "silence":
                before = window(audio, sr, ev["start"] - 0.03, 0.02)
                after = window(audio, sr, ev["start"] + 0.03, 0.02)
                assert np.sqrt(np.mean(before**2)) < 0.005 < 0.03 < np.sqrt(np.mean(after**2))


@pytest.mark.parametrize("sample_rate", [16000, 44100])
def test_every_colour_shape_and_sound_survives_encoding(tmp_path, sample_rate):
    fps, k = 8, len(syn.COLOURS)
    events, cursor = [], 8
    for i in range(k):
        events.append(media.EventSpec(cursor, cursor + 16, syn.COLOURS[i], syn.SHAPES[i % 4], syn.MOTIONS[i],
                                      syn.SOUNDS[i]))
        cursor += 16 + 8
    script = media.VideoScript("all", "train", cursor, fps, sample_rate, 64, 64, tuple(events), (7, 0, 1))
    path = syn.render_video(script, str(tmp_path / "all.mp4"))
    frames = decode_frames(path)
    audio, sr = decode_audio(path)
    assert sr == sample_rate and len(frames) == cursor
    for ev in events:
        mid = (ev.start_frame + ev.end_frame) / 2
        frame = frames[int(mid)]
        assert nearest_colour(shape_pixels(frame).mean(0)) == ev.colour
        check_sound(window(audio, sr, mid / fps), sr, ev.sound)


def test_motion_is_visible(tmp_path):
    """Where the shape is early vs late in the event follows the motion word."""
    fps = 8
    motions = ["moves to the left", "moves to the right", "moves up", "moves down", "grows", "shrinks"]
    events = [media.EventSpec(8 + 32 * i, 8 + 32 * i + 24, "red", "square", m, "silence") for i, m in enumerate(motions)]
    script = media.VideoScript("m", "train", 8 + 32 * len(motions), fps, 16000, 64, 64, tuple(events), (1, 2, 3))
    frames = decode_frames(syn.render_video(script, str(tmp_path / "m.mp4")))

    def stats(frame):
        mask = np.abs(frame.astype(np.float64) - BG).max(axis=2) > 60
        ys, xs = np.nonzero(mask)
        return xs.mean(), ys.mean(), mask.sum()

    for ev in events:
        x0, y0, n0 = stats(frames[ev.start_frame + 1])
        x1, y1, n1 = stats(frames[ev.end_frame - 2])
        got = {"moves to the left": x1 < x0 - 10, "moves to the right": x1 > x0 + 10, "moves up": y1 < y0 - 10,
               "moves down": y1 > y0 + 10, "grows": n1 > 2 * n0, "shrinks": n0 > 2 * n1}[ev.motion]
        assert got, (ev.motion, x0, x1, y0, y1, n0, n1)


def test_annotation_formats_agree(corpus):
    lv = _load_longvale(corpus)
    seen = []
    for split, path in corpus.chronusav.items():
        for rec in json.loads(Path(path).read_text()):
            seen.append(rec["id"])
            ref = lv[rec["id"]]
            assert ref["split"] == split and rec["category"] == syn.CATEGORY
            assert rec["duration"] == ref["duration"] and rec["seg_time"] == ref["timestamps"]
            assert rec["segment_num"] == len(rec["seg_time"]) == len(rec["video_captions"]) == len(rec["audio_captions"])
            joined = [f"Visual: {v} Audio: {a}" for v, a in zip(rec["video_captions"], rec["audio_captions"])]
            assert joined == ref["sentences"]
    assert sorted(seen) == sorted(lv)


def test_same_seed_same_corpus_other_seed_differs(corpus, tmp_path):
    again = syn.generate_corpus(tmp_path / "b", dataclasses.replace(CFG, num_workers=1), progress=False)
    for fmt in ("longvale", "chronusav"):
        for split in ("train", "test"):
            assert Path(corpus.annotations(fmt)[split]).read_bytes() == Path(again.annotations(fmt)[split]).read_bytes()
    for vid, path in corpus.videos.items():  # byte-identical files, whichever worker wrote them
        assert Path(path).read_bytes() == Path(again.videos[vid]).read_bytes(), vid
    other = syn.script_corpus(dataclasses.replace(CFG, seed=1))
    assert [p.events for p in other] != [p.events for p in syn.script_corpus(CFG)]


# SHA-256 (first 32 hex digits) of CFG's videos: libx264 runs its C code only (media.X264_PARAMS), so
# these are the bytes on every x86 CPU (recorded on an AVX-512 CPU, equal under valgrind's, which has none)
CORPUS_SHA256 = {
    "synth_00000": "a4739ca0773e55093a80b7a35d00631a",
    "synth_00001": "efe30c215543c327f5f50c2d5c7e41b9",
    "synth_00002": "0a85585f0f35ea72f08244604ed7a980",
    "synth_00003": "f54f662aafc689da8caa3ea26e6f5ab4",
}


def test_corpus_bytes_are_the_same_on_every_cpu(corpus):
    got = {vid: hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32] for vid, path in corpus.videos.items()}
    assert got == CORPUS_SHA256


def test_yuv420p_conversion_matches_libswscale():
    """Luma within one level of libswscale's; chroma differs only at shape edges (a 2x2 mean
    where libswscale filters), under one level on average."""
    script = syn.script_corpus(CFG)[0]
    frames = media.render_frames(script, np.random.default_rng(list(script.entropy)))
    h = frames.shape[1]
    for rgb in frames[:: max(1, len(frames) // 8)]:
        ours = media.rgb_to_yuv420p(rgb).astype(int)
        theirs = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(format="yuv420p").to_ndarray()
        assert ours.shape == theirs.shape
        assert np.abs(ours[:h] - theirs[:h]).max() <= 1
        assert np.abs(ours[h:] - theirs[h:]).mean() < 1.0


def test_existing_identical_corpus_is_reused(corpus):
    before = {p: Path(p).stat().st_mtime_ns for p in corpus.videos.values()}
    again = syn.generate_corpus(corpus.root, CFG, progress=False)
    assert again.reused and {p: Path(p).stat().st_mtime_ns for p in again.videos.values()} == before


def test_cli(tmp_path, capsys):
    rc = syn.main(["--out", str(tmp_path), "--num-videos", "2", "--seed", "3", "--min-duration", "8",
                   "--max-duration", "9", "--width", "32", "--height", "32", "--workers", "1", "--preview"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["videos"] == 2 and summary["splits"] == {"train": 1, "test": 1}
    assert len(list((tmp_path / "videos").glob("*.mp4"))) == 2
    assert Path(summary["preview"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert syn.main(["--out", str(tmp_path), "--num-videos", "1", "--min-duration", "2", "--max-duration", "3"]) == 2


def test_within_video_colours_and_sounds_are_distinct():
    for script in syn.script_corpus(dataclasses.replace(CFG, num_videos=40, max_events=8, min_duration=40, max_duration=60)):
        colours = [e.colour for e in script.events]
        sounds = [e.sound for e in script.events]
        assert len(set(colours)) == len(colours) and len(set(sounds)) == len(sounds)
        starts = [e.start_frame for e in script.events]
        assert starts == sorted(starts) and script.events[0].start_frame >= 8 and script.events[-1].end_frame <= script.num_frames - 8


@pytest.mark.parametrize(
    "bad",
    [dict(max_events=9), dict(min_events=3, max_events=2), dict(width=95), dict(test_fraction=1.0),
     dict(sample_rate=12345), dict(min_duration=5.0, max_duration=6.0, min_events=3)],
)
def test_invalid_config_is_explained(bad):
    with pytest.raises(ValueError, match="synthetic"):
        syn.validate_config(dataclasses.replace(CFG, **bad))


def test_grammar_round_trip_and_size():
    combos = list(itertools.product(syn.COLOURS, syn.SHAPES, syn.MOTIONS, syn.SOUNDS))
    assert len(combos) >= 1000
    assert media.TONE_HZ["low beep"] < media.TONE_HZ["mid beep"] < media.TONE_HZ["high beep"]
    captions = {syn.dense_caption(*c) for c in combos}
    assert len(captions) == len(combos)
    for c in combos:
        parsed = syn.parse_caption(syn.dense_caption(*c))
        assert parsed == dict(zip(syn.ATTRIBUTES, c))


def test_parse_caption_is_tolerant():
    assert syn.dense_caption("red", "circle", "moves to the left", "high beep") == \
        "Visual: the red circle moves to the left. Audio: a high beep."
    assert syn.visual_caption("orange", "square", "grows") == "the orange square grows."
    assert syn.visual_caption("red", "stripes", "moves up") == "the red striped square moves up."
    assert syn.parse_caption("Visual: the red striped square moves up. Audio: silence.")["shape"] == "stripes"
    # the earlier template ('a' / 'an', 'a set of ... stripes') still parses
    assert syn.parse_caption("Visual: an orange square grows. Audio: a low beep.")["colour"] == "orange"
    assert syn.parse_caption("Visual: a set of red stripes moves up.")["shape"] == "stripes"
    p = syn.parse_caption("visual: A WHITE square blinks.  audio: white noise")
    assert p == {"colour": "white", "shape": "square", "motion": "blinks", "sound": "white noise"}
    p = syn.parse_caption("a blue triangle with white noise")  # no Audio: marker
    assert p["colour"] == "blue" and p["shape"] == "triangle" and p["sound"] == "white noise" and p["motion"] is None
    p = syn.parse_caption("white noise only")
    assert p["colour"] is None and p["sound"] == "white noise"
    assert syn.parse_caption("") == {"colour": None, "shape": None, "motion": None, "sound": None}
    assert syn.parse_caption("Visual: a green stripe grows. Audio: silent")["shape"] == "stripes"
    assert syn.parse_caption("Visual: a reddish circle. Audio: a beep.")["colour"] is None
