"""preprocess.media: frame schedules, real mp4 decoding (decord + PyAV), every MediaError kind, s3://."""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile

import numpy as np
import pytest

from bench.mp4 import solid_frames, tone, write_mp4
from pipeline.config import FeaturesConfig
from preprocess.media import MediaError, decode_video, frame_schedule

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 255, 0)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    v = {
        # 4 s, 8 fps, 64x48, red then blue; stereo 44.1 kHz 440 Hz tone starting at 1 s
        "av": write_mp4(d / "av.mp4", solid_frames(32, 48, 64, [RED, BLUE]), audio=tone(440, 4.0, silent_until=1.0)),
        "noaudio": write_mp4(d / "noaudio.mp4", solid_frames(16, 48, 64, [GREEN])),
        "tiny": write_mp4(d / "tiny clip ü é 视频.mp4", solid_frames(4, 16, 16, [BLUE]), audio=tone(300, 0.5, 22050), sample_rate=22050, layout="mono"),
        "hd": write_mp4(d / "full hd ✓.mp4", solid_frames(3, 1080, 1920, [GREEN]), fps=10),
        "audio_only": write_mp4(d / "audio only.mp4", None, audio=tone(440, 1.0)),
    }
    data = v["av"].read_bytes()
    (d / "truncated.mp4").write_bytes(data[: len(data) // 2])
    v["truncated"] = d / "truncated.mp4"
    (d / "empty.mp4").write_bytes(b"")
    v["empty"] = d / "empty.mp4"
    (d / "notes.mp4").write_text("this is not a video, just a text file\n")
    v["text"] = d / "notes.mp4"
    rng = np.random.default_rng(0)
    (d / "noise.mp4").write_bytes(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    v["noise"] = d / "noise.mp4"
    # Keep the mp4 box layout, scramble the coded video payload: opens, fails to decode.
    garbled = bytearray(data)
    mdat = garbled.find(b"mdat") + 4
    garbled[mdat + 64 : mdat + 20000] = rng.integers(0, 256, 20000 - 64, dtype=np.uint8).tobytes()
    (d / "garbled.mp4").write_bytes(bytes(garbled))
    v["garbled"] = d / "garbled.mp4"
    return {k: str(p) for k, p in v.items()}


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("duration,n", [(10.0, 64), (60.0, 120), (100.0, 200), (500.0, 256), (40.6, 82), (0.3, 64)])
def test_count_schedule_is_the_paper_rule(duration, n):
    cfg = FeaturesConfig()  # clip(round(duration / 0.5), 64, 256), 2 frames per segment
    times, segs = frame_schedule(duration, cfg)
    assert times.shape == (n,) and segs.shape == (n // 2, 2)
    d = 2 * duration / n
    np.testing.assert_allclose(segs[:, 0], np.arange(n // 2) * d, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(segs[:, 1] - segs[:, 0], d, rtol=1e-4)
    assert segs[-1, 1] == np.float32(duration) and segs[0, 0] == 0
    np.testing.assert_array_equal(segs[1:, 0], segs[:-1, 1])  # contiguous
    np.testing.assert_allclose(times, (np.arange(n) + 0.5) * duration / n, rtol=1e-5)
    # every frame lies inside its segment
    seg_of = np.repeat(np.arange(n // 2), 2)
    assert (times >= segs[seg_of, 0]).all() and (times <= segs[seg_of, 1]).all()


def test_count_schedule_rounds_to_whole_segments():
    cfg = dataclasses.replace(FeaturesConfig(), frames_per_segment=3, min_frames=4, max_frames=20)
    assert frame_schedule(3.0, cfg)[0].shape == (6,)  # round(6) = 6
    assert frame_schedule(3.5, cfg)[0].shape == (9,)  # 7 -> up to 9
    assert frame_schedule(100.0, cfg)[0].shape == (18,)  # 20 -> 21 passes max -> down to 18


def test_fps_schedule_pads_the_last_segment():
    cfg = dataclasses.replace(FeaturesConfig(), frame_policy="fps", fps=3.0, frames_per_segment=4)
    times, segs = frame_schedule(3.1, cfg)  # ceil(9.3) = 10 frames -> 3 segments, 2 padded
    np.testing.assert_allclose(times[:10], np.minimum((np.arange(10) + 0.5) / 3, 3.1), rtol=1e-6)
    assert times.shape == (12,) and times[10] == times[11] == times[9]
    np.testing.assert_allclose(segs, [[0, 4 / 3], [4 / 3, 8 / 3], [8 / 3, 3.1]], rtol=1e-6)
    capped = dataclasses.replace(cfg, min_frames=8, max_frames=8)  # 10 > 8: count rule with n = 8
    times, segs = frame_schedule(3.1, capped)
    assert times.shape == (8,) and segs.shape == (2, 2) and segs[-1, 1] == np.float32(3.1)


# --------------------------------------------------------------------------- decoding


def test_decode_frames_segments_and_audio(videos):
    cfg = FeaturesConfig()
    d = decode_video(videos["av"], cfg)
    assert d.duration == pytest.approx(4.0)
    assert d.frames.shape == (64, 32, 32, 3) and d.frames.dtype == np.uint8
    assert d.segment_times.shape == (32, 2) and d.segment_times.dtype == np.float32
    assert d.segment_times[-1, 1] == pytest.approx(4.0)
    # colour of decoded frames: red first half, blue second half
    np.testing.assert_allclose(d.frames[0].reshape(-1, 3).mean(0), RED, atol=8)
    np.testing.assert_allclose(d.frames[-1].reshape(-1, 3).mean(0), BLUE, atol=8)
    first_blue = np.argmax(d.frames[:, 16, 16, 2] > 128)
    frame_times, _ = frame_schedule(d.duration, cfg)  # the time each decoded frame stands for
    assert frame_times[first_blue] >= 2.0 and frame_times[first_blue - 1] < 2.0
    # audio: 16 kHz mono, exactly duration * 16000 samples, on the video timeline
    assert d.has_audio and d.sample_rate == 16000
    assert d.audio.dtype == np.float32 and d.audio.shape == (64000,)
    onset = np.argmax(np.abs(d.audio) > 0.05) / 16000
    assert onset == pytest.approx(1.0, abs=0.01)
    spectrum = np.abs(np.fft.rfft(d.audio[20000:36000]))
    assert np.argmax(spectrum) * 16000 / 16000 == pytest.approx(440, abs=2)
    assert np.abs(d.audio[20000:]).max() == pytest.approx(0.5, abs=0.05)  # channels averaged, not summed


def test_decode_fps_policy(videos):
    cfg = dataclasses.replace(FeaturesConfig(), frame_policy="fps", fps=2.0)
    d = decode_video(videos["av"], cfg)
    assert d.frames.shape[0] == 8 and d.num_segments == 4
    np.testing.assert_allclose(d.segment_times, [[0, 1], [1, 2], [2, 3], [3, 4]], atol=1e-6)


def test_video_without_audio_is_valid(videos):
    d = decode_video(videos["noaudio"], FeaturesConfig())
    assert not d.has_audio and d.audio is None
    assert d.duration == pytest.approx(2.0) and d.num_segments == 32
    np.testing.assert_allclose(d.frames[5].reshape(-1, 3).mean(0), GREEN, atol=8)


def test_tiny_and_full_hd_with_unicode_names(videos):
    tiny = decode_video(videos["tiny"], FeaturesConfig())  # 16x16, 4 frames, 22.05 kHz mono audio
    assert tiny.frames.shape == (64, 32, 32, 3)
    assert tiny.duration == pytest.approx(0.5) and tiny.audio.shape == (8000,)
    np.testing.assert_allclose(tiny.frames[-1].reshape(-1, 3).mean(0), BLUE, atol=10)
    cfg = dataclasses.replace(FeaturesConfig(), image_size=0, frame_policy="fps", fps=10.0)
    hd = decode_video(videos["hd"], cfg)  # source size kept
    assert hd.frames.shape == (4, 1080, 1920, 3)  # image_size 0: the source's 1920x1080
    assert hd.duration == pytest.approx(0.3) and not hd.has_audio
    np.testing.assert_allclose(hd.frames[0, ::97, ::97].reshape(-1, 3).mean(0), GREEN, atol=8)
    small = decode_video(videos["hd"], FeaturesConfig())
    assert small.frames.shape == (64, 32, 32, 3)


@pytest.mark.parametrize(
    "name,kind,words",
    [
        ("missing", "missing", "missing file"),
        ("empty", "empty", "zero-byte"),
        ("truncated", "truncated", "truncated"),
        ("text", "not_media", "text file"),
        ("noise", "not_media", "not a readable media container"),
        ("garbled", "undecodable", "cannot be decoded"),
        ("audio_only", "no_video", "no video stream"),
    ],
)
def test_media_errors(videos, name, kind, words):
    uri = videos.get(name, os.path.join(os.path.dirname(videos["av"]), "does not exist.mp4"))
    with pytest.raises(MediaError) as err:
        decode_video(uri, FeaturesConfig())
    assert err.value.kind == kind and words in str(err.value) and uri in str(err.value)


def test_size_limit(videos):
    cfg = dataclasses.replace(FeaturesConfig(), max_media_bytes=1000)
    with pytest.raises(MediaError, match="over features.max_media_bytes") as err:
        decode_video(videos["av"], cfg)
    assert err.value.kind == "too_large"


# --------------------------------------------------------------------------- s3


@pytest.fixture(scope="module")
def moto_s3():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def _temp_copies() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "padcap-media-*")))


def test_s3_streamed_to_one_temp_copy(videos, moto_s3, monkeypatch):
    import s3fs

    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": moto_s3}}
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("media-bucket")
    fs.put(videos["av"], "media-bucket/dir/clip ü.mp4")
    fs.put(videos["empty"], "media-bucket/dir/empty.mp4")
    before = _temp_copies()
    cfg = FeaturesConfig()
    remote = decode_video("s3://media-bucket/dir/clip ü.mp4", cfg, storage_options=opts)
    local = decode_video(videos["av"], cfg)
    np.testing.assert_array_equal(remote.frames, local.frames)
    np.testing.assert_array_equal(remote.audio, local.audio)
    for name, kind in [("missing.mp4", "missing"), ("empty.mp4", "empty")]:
        with pytest.raises(MediaError) as err:
            decode_video(f"s3://media-bucket/dir/{name}", cfg, storage_options=opts)
        assert err.value.kind == kind
    with pytest.raises(MediaError) as err:  # the download is bounded too
        decode_video("s3://media-bucket/dir/clip ü.mp4", dataclasses.replace(cfg, max_media_bytes=100), storage_options=opts)
    assert err.value.kind == "too_large"
    # without explicit options the endpoint comes from the environment, as for every run path
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    env = decode_video("s3://media-bucket/dir/clip ü.mp4", cfg)
    np.testing.assert_array_equal(env.frames, local.frames)
    assert _temp_copies() == before  # temp copies removed, also after errors


# --------------------------------------------------------------------------- metadata and codecs


def test_non_utf8_metadata_does_not_reject_a_valid_video(videos, tmp_path):
    # Old cameras and some muxers write Latin-1 / GBK tags; the streams are fine.
    import av

    tagged = tmp_path / "tagged.mp4"
    with av.open(videos["av"]) as src, av.open(str(tagged), "w", format="mp4") as out:
        out.metadata["title"] = "Café QQ"
        streams = {s.index: out.add_stream_from_template(s) for s in src.streams}
        for packet in src.demux():
            if packet.dts is not None:
                packet.stream = streams[packet.stream.index]
                out.mux(packet)
    data = tagged.read_bytes()
    assert data.count("Café QQ".encode()) == 1
    latin1 = tmp_path / "latin1 tag.mp4"
    latin1.write_bytes(data.replace("Café QQ".encode(), "Café QQQ".encode("latin-1")))  # same length
    d = decode_video(str(latin1), FeaturesConfig())
    ref = decode_video(videos["av"], FeaturesConfig())
    assert d.has_audio and d.duration == pytest.approx(ref.duration)
    np.testing.assert_array_equal(d.frames, ref.frames)
    np.testing.assert_array_equal(d.audio, ref.audio)


def test_video_codec_without_decoder_is_a_media_error(videos, tmp_path):
    unknown = tmp_path / "unknown codec.mp4"
    data = bytearray(open(videos["av"], "rb").read())
    entry = data.index(b"avc1", data.index(b"stsd"))  # the sample entry's codec tag (not the ftyp brand)
    data[entry : entry + 4] = b"zzzz"
    unknown.write_bytes(bytes(data))
    with pytest.raises(MediaError) as err:
        decode_video(str(unknown), FeaturesConfig())
    assert err.value.kind == "undecodable" and "codec" in str(err.value) and str(unknown) in str(err.value)
