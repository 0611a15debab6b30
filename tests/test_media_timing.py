"""preprocess.timing through decode_video: VFR lengths, truncated Matroska/WebM/AVI, untrustworthy timing.

The files are written here with PyAV (tests/support/mp4.write_timed): 30 fps for 2 s, then
2 fps, the last frame lasting 0.5 s, so every container declares 4.0 s and decord's
own guess for the last frame (one average-rate frame) would end at 3.533 s.
"""

from __future__ import annotations

import pytest

from pipeline.config import FeaturesConfig
from preprocess.media import MediaError, decode_video
from tests.support.mp4 import write_timed

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


def test_declared_length_before_the_last_frame_is_untrustworthy(timed):
    with pytest.raises(MediaError) as err:
        decode_video(timed["lying.mkv"], FeaturesConfig())
    assert err.value.kind == "bad_timing" and "track DURATION tag says 1.000 s" in str(err.value)
