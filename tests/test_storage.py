"""Storage helpers against local paths and a real S3 server on 127.0.0.1."""

from __future__ import annotations

import pytest

from pipeline import storage


def test_local_round_trip(tmp_path):
    p = str(tmp_path / "a" / "b.json")
    storage.write_json(p, {"x": [1, 2]})
    assert storage.exists(p) and storage.read_json(p) == {"x": [1, 2]}
    assert storage.list_files(str(tmp_path), (".json",)) == [p]
    assert storage.join("s3://b/p/", "x", "/y") == "s3://b/p/x/y"


@pytest.mark.integration
def test_s3_round_trip_and_upload(s3_server, tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f.txt").write_text("hello")
    (tmp_path / "d" / "g.txt").write_text("world")
    storage.upload_dir(str(tmp_path / "d"), "s3://test/up")
    files = storage.list_files("s3://test/up")
    assert files == ["s3://test/up/e/f.txt", "s3://test/up/g.txt"]
    assert storage.read_bytes("s3://test/up/e/f.txt") == b"hello"
    storage.write_json("s3://test/x/stamp.json", {"ok": True})
    assert storage.exists("s3://test/x/stamp.json") and storage.read_json("s3://test/x/stamp.json") == {"ok": True}
    assert not storage.exists("s3://test/x/none.json")
