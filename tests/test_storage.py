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


@pytest.mark.integration
def test_listing_a_prefix_of_more_objects_than_one_s3_page(s3_server):
    """An S3 listing answers at most 1,000 keys per request: a prefix of 1,100 is listed whole."""
    fs, inner = storage.filesystem("s3://test/many")
    fs.pipe({f"{inner}/v{i:05d}.mp4": b"x" for i in range(1100)})
    files = storage.list_files("s3://test/many", (".mp4",))
    assert len(files) == 1100 and files[0] == "s3://test/many/v00000.mp4" and files[-1] == "s3://test/many/v01099.mp4"


def test_a_filesystem_carrying_credentials_works_where_the_environment_has_none(s3_server, tmp_path):
    """Ray Train's controller unpickles the checkpoint filesystem in a process started by the raylet,
    whose environment may lack the driver's AWS_* variables: with carry_credentials the pickled
    filesystem holds them (and the endpoint), and reads and writes there."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    storage.write_json("s3://test/cred/in.json", {"n": 1})
    fs, inner = storage.filesystem("s3://test/cred", carry_credentials=True)
    assert fs.storage_options.get("key") == os.environ["AWS_ACCESS_KEY_ID"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    script = ("import pickle, sys; fs = pickle.loads(sys.stdin.buffer.read()); "
              "sys.stdout.write(fs.cat_file(sys.argv[1] + '/in.json').decode()); "
              "fs.pipe_file(sys.argv[1] + '/out.json', b'{\"n\": 2}')")
    out = subprocess.run([sys.executable, "-c", script, inner], input=pickle.dumps(fs), env=env,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert json.loads(out.stdout.decode()) == {"n": 1}
    assert storage.read_json("s3://test/cred/out.json") == {"n": 2}
    plain, _ = storage.filesystem("s3://test/cred")
    assert "key" not in plain.storage_options and "secret" not in plain.storage_options
