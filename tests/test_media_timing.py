"""preprocess.timing through decode_video: VFR lengths, truncated Matroska/WebM/AVI, untrustworthy timing.

Two sets of files. Written here with PyAV (tests/support/mp4.write_timed): 30 fps for 2 s,
then 2 fps, the last frame lasting 0.5 s, so every container declares 4.0 s and decord's
own guess for the last frame (one average-rate frame) would end at 3.533 s. Written by the
ffmpeg CLI as archives are (`ffmpeg_files`; skipped where there is no ffmpeg binary,
`.ci/run` installs it): the same 30-then-2 fps video with 4 s of audio, in mp4 with and
without B-frames, remuxed to Matroska, encoded to WebM, delayed 0.5 s by an mp4 edit
list, and cut short; each must last what a player shows, with an event in its 2 fps tail.
"""

from __future__ import annotations

import shutil
import struct
import subprocess

import pytest

from bench.mp4 import write_timed
from pipeline.config import FeaturesConfig
from pipeline.schema import Event
from preprocess.events import align_events
from preprocess.media import MediaError, decode_video

VFR_TIMES = [i / 30 for i in range(60)] + [2.0, 2.5, 3.0, 3.5]
CFR_TIMES = [i / 30 for i in range(90)]  # 3 s at 30 fps


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    d = tmp_path_factory.mktemp("timed")
    files = {}
    for ext in ("mp4", "mkv", "webm", "avi"):
        files[f"vfr.{ext}"] = write_timed(d / f"vfr.{ext}", VFR_TIMES, last=0.5)
        cfr = write_timed(d / f"cfr.{ext}", CFR_TIMES, last=1 / 30, audio_seconds=3.0)
        data = cfr.read_bytes()
        (d / f"cut.{ext}").write_bytes(data[: len(data) * 6 // 10])
        files[f"cut.{ext}"] = d / f"cut.{ext}"
        files[f"cfr.{ext}"] = cfr
    # The Matroska track tag says the video lasts 1 s, its frames run to 3.5 s.
    data = files["vfr.mkv"].read_bytes()
    assert data.count(b"00:00:04.000000000") == 1
    (d / "lying.mkv").write_bytes(data.replace(b"00:00:04.000000000", b"00:00:01.000000000"))
    files["lying.mkv"] = d / "lying.mkv"
    return {k: str(v) for k, v in files.items()}


@pytest.mark.parametrize("ext", ["mp4", "mkv", "webm", "avi"])
def test_vfr_video_lasts_until_its_declared_end(timed, ext):
    d = decode_video(timed[f"vfr.{ext}"], FeaturesConfig())
    assert d.duration == pytest.approx(4.0, abs=1e-3)
    assert float(d.segment_times[-1, 1]) == pytest.approx(4.0, abs=1e-3)
    # the 2 fps part is sampled where it is: the last segment shows the last frame (value 63*37 % 256)
    assert abs(float(d.frames[-1].mean()) - (63 * 37) % 256) < 12


@pytest.mark.parametrize("ext", ["mp4", "mkv", "webm", "avi"])
def test_whole_files_decode_and_cut_ones_are_truncated_rows(timed, ext):
    whole = decode_video(timed[f"cfr.{ext}"], FeaturesConfig())
    assert whole.duration == pytest.approx(3.0, abs=0.04) and whole.has_audio
    with pytest.raises(MediaError) as err:
        decode_video(timed[f"cut.{ext}"], FeaturesConfig())
    assert err.value.kind == "truncated" and "truncated" in str(err.value) and timed[f"cut.{ext}"] in str(err.value)


def test_a_track_tag_that_ends_early_gives_way_to_the_container_end(timed):
    """The Matroska track tag says 1 s, the segment 4 s and the frames run to 3.5 s: a player
    plays 4 s, so that is the length (the tag is not what plays; it is no contradiction)."""
    assert decode_video(timed["lying.mkv"], FeaturesConfig()).duration == pytest.approx(4.0, abs=1e-3)


def test_frames_after_the_container_end_are_untrustworthy(timed, tmp_path):
    """The segment's Duration (float64 ms) patched to 1 s while the frames run to 3.5 s."""
    data = open(timed["vfr.mkv"], "rb").read()
    stated = b"\x44\x89\x88" + struct.pack(">d", 4000.0)
    assert data.count(stated) == 1
    path = tmp_path / "ends-early.mkv"
    path.write_bytes(data.replace(stated, b"\x44\x89\x88" + struct.pack(">d", 1000.0)))
    with pytest.raises(MediaError) as err:
        decode_video(str(path), FeaturesConfig())
    assert err.value.kind == "bad_timing" and "the container says it ends at 1.000 s" in str(err.value)


# ----------------------------------------------------------------------------- files from the ffmpeg CLI

FFMPEG = shutil.which("ffmpeg")
# the command: 2 s of testsrc at 30 fps, then 2 s at 2 fps (frames at 2.0 ... 3.5), 4 s of audio
VFR_INPUTS = ["-f", "lavfi", "-i", "testsrc=rate=30:duration=2", "-f", "lavfi", "-i", "testsrc=rate=2:duration=2",
              "-f", "lavfi", "-i", "sine=duration=4", "-filter_complex", "[0:v][1:v]concat=n=2:v=1:a=0[v]",
              "-map", "[v]", "-map", "2:a", "-fps_mode", "vfr"]
TAIL_EVENT = Event(3.6, 3.9, "in the 2 fps tail: the last frame (3.5 s) is on screen")
# what a player shows, on the video timeline (0 = first video frame)
FFMPEG_LENGTHS = {"vfr.mp4": 4.0, "vfr-bf0.mp4": 4.0, "vfr.mkv": 4.0, "vfr.webm": 4.0,
                  "offset.mp4": 4.055 - 0.5}  # the edit list delays the video 0.5 s; the container ends at 4.055


def _ffmpeg(*args: str) -> None:
    subprocess.run([FFMPEG, "-nostdin", "-loglevel", "error", "-y", *args], check=True, timeout=120)


@pytest.fixture(scope="module")
def ffmpeg_files(tmp_path_factory):
    if FFMPEG is None:
        pytest.skip("no ffmpeg binary (apt-get install ffmpeg; .ci/run installs it)")
    d = tmp_path_factory.mktemp("ffmpeg")
    _ffmpeg(*VFR_INPUTS, "-c:v", "libx264", "-c:a", "aac", str(d / "vfr.mp4"))
    _ffmpeg(*VFR_INPUTS, "-c:v", "libx264", "-bf", "0", "-c:a", "aac", str(d / "vfr-bf0.mp4"))
    _ffmpeg("-i", str(d / "vfr.mp4"), "-c", "copy", str(d / "vfr.mkv"))
    _ffmpeg(*VFR_INPUTS, "-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-c:a", "libopus",
            str(d / "vfr.webm"))
    _ffmpeg("-itsoffset", "0.5", "-i", str(d / "vfr-bf0.mp4"), "-i", str(d / "vfr-bf0.mp4"),
            "-map", "0:v", "-map", "1:a", "-c", "copy", str(d / "offset.mp4"))
    _ffmpeg(*VFR_INPUTS, "-c:v", "libx264", "-c:a", "aac", "-movflags", "+faststart", str(d / "whole.mp4"))
    for name, src in (("cut.mp4", "whole.mp4"), ("cut.mkv", "vfr.mkv")):
        data = (d / src).read_bytes()
        (d / name).write_bytes(data[: len(data) * 6 // 10])
    return d


@pytest.mark.parametrize("name", sorted(FFMPEG_LENGTHS))
def test_ffmpeg_written_vfr_files_last_what_a_player_shows(ffmpeg_files, name):
    d = decode_video(str(ffmpeg_files / name), FeaturesConfig())
    print(f"[ffmpeg] {name}: duration {d.duration:.3f} s")
    assert d.duration == pytest.approx(FFMPEG_LENGTHS[name], abs=0.03)  # WebM: Opus pre-skip moves its end
    assert float(d.segment_times[-1, 1]) == pytest.approx(d.duration)
    tail = TAIL_EVENT if name != "offset.mp4" else Event(3.1, 3.4, TAIL_EVENT.caption)  # its frames start at 0.5
    [kept] = align_events([tail], d.duration, tolerance=0.0, video_id=name)  # inside, nothing clipped
    assert (kept.start, kept.end) == (tail.start, tail.end)


@pytest.mark.parametrize("name", ["cut.mp4", "cut.mkv"])
def test_ffmpeg_written_files_cut_short_are_truncated_rows(ffmpeg_files, name):
    with pytest.raises(MediaError) as err:
        decode_video(str(ffmpeg_files / name), FeaturesConfig())
    assert err.value.kind == "truncated", err.value
