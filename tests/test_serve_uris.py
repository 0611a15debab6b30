"""The serving endpoint's URI allow-list (infer/serving/uris.py): many hostile and benign cases, no Ray.

Also the capped readers: local size check before reading, http(s) fetches against a
real http.server on 127.0.0.1 (declared and undeclared oversize bodies, redirects,
404), and S3 fetches against the real SeaweedFS fixture (integration).
"""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest

from infer.serving.errors import RequestError
from infer.serving.uris import Source, UriError, UriPolicy, materialize

EXTS = [".mp4", ".mkv"]


@pytest.fixture()
def tree(tmp_path: Path):
    """root/ (allowed) with files, inner and escaping symlinks; outside/ and root-evil/ beside it."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.mp4").write_bytes(b"\x00" * 100)
    (root / "sub" / "b.mkv").write_bytes(b"\x00" * 10)
    (root / "notes.txt").write_text("hello")
    (root / "folder.mp4").mkdir()
    os.mkfifo(root / "pipe.mp4")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.mp4").write_bytes(b"\x00" * 7)
    evil = tmp_path / "root-evil"
    evil.mkdir()
    (evil / "x.mp4").write_bytes(b"\x00" * 5)
    (root / "link_in.mp4").symlink_to(root / "a.mp4")
    (root / "link_out.mp4").symlink_to(outside / "secret.mp4")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    (root / "dangling.mp4").symlink_to(outside / "nope.mp4")
    alias = tmp_path / "alias"  # a root given through a symlink
    alias.symlink_to(root, target_is_directory=True)
    return {"tmp": tmp_path, "root": root, "outside": outside, "alias": alias}


@pytest.fixture()
def policy(tree):
    return UriPolicy([str(tree["root"]), "s3://media/clips"], ["videos.example.org", "127.0.0.1:8123"], EXTS)


def _status(policy: UriPolicy, uri) -> tuple[int, str]:
    with pytest.raises(UriError) as info:
        policy.resolve(uri)
    return info.value.status, info.value.code


# ------------------------------------------------------------------------ accepted


def test_plain_path_inside_root(policy, tree):
    src = policy.resolve(str(tree["root"] / "a.mp4"))
    assert src == Source("local", str(tree["root"] / "a.mp4"), "a.mp4", 100)


def test_nested_and_file_uris(policy, tree):
    assert policy.resolve(str(tree["root"] / "sub" / "b.mkv")).size == 10
    assert policy.resolve(f"file://{tree['root']}/a.mp4").location == str(tree["root"] / "a.mp4")
    assert policy.resolve(f"file://localhost{tree['root']}/a.mp4").kind == "local"
    assert policy.resolve(f"file://{tree['root']}/%61.mp4").name == "a.mp4"  # percent-decoded


def test_symlink_inside_root_resolves_to_its_target(policy, tree):
    src = policy.resolve(str(tree["root"] / "link_in.mp4"))
    assert src.location == str(tree["root"] / "a.mp4")


def test_root_configured_through_a_symlink(tree):
    p = UriPolicy([str(tree["alias"])], [], EXTS)
    assert p.resolve(str(tree["alias"] / "a.mp4")).location == str(tree["root"] / "a.mp4")
    assert p.resolve(str(tree["root"] / "a.mp4")).kind == "local"  # same real directory


def test_s3_and_http_accepted(policy):
    assert policy.resolve("s3://media/clips/x/y.mp4") == Source("s3", "s3://media/clips/x/y.mp4", "y.mp4")
    assert policy.resolve("https://videos.example.org/a/b.mp4").kind == "http"
    assert policy.resolve("http://VIDEOS.example.org:80/b.mp4").kind == "http"
    assert policy.resolve("http://127.0.0.1:8123/v.mp4").location == "http://127.0.0.1:8123/v.mp4"


def test_whole_bucket_root():
    p = UriPolicy(["s3://media"], [], EXTS)
    assert p.resolve("s3://media/any/where.mp4").kind == "s3"
    assert _status(p, "s3://other/any.mp4") == (403, "outside_roots")


# ------------------------------------------------------------------------ refused

LOCAL_REFUSALS = [
    # (uri template, status, code); {root}, {out}, {tmp} are filled in
    ("{root}/../outside/secret.mp4", 403, "path_traversal"),
    ("{root}/sub/../a.mp4", 403, "path_traversal"),
    ("{root}/..", 403, "path_traversal"),
    ("file://{root}/%2e%2e/outside/secret.mp4", 403, "path_traversal"),
    ("{root}/link_out.mp4", 403, "outside_roots"),
    ("{root}/linkdir/secret.mp4", 403, "outside_roots"),
    ("{root}/dangling.mp4", 403, "outside_roots"),
    ("{out}/secret.mp4", 403, "outside_roots"),
    ("file://{out}/secret.mp4", 403, "outside_roots"),
    ("{tmp}/root-evil/x.mp4", 403, "outside_roots"),  # shares the root's string prefix
    ("/etc/passwd", 403, "outside_roots"),
    ("/etc/does-not-exist.mp4", 403, "outside_roots"),  # containment before existence
    ("{root}", 415, "not_a_video"),
    ("{root}/missing.mp4", 404, "not_found"),
    ("{root}/notes.txt", 415, "not_a_video"),
    ("{root}/folder.mp4", 400, "not_a_file"),
    ("{root}/pipe.mp4", 400, "not_a_file"),
    ("file://evil.example.org{root}/a.mp4", 400, "bad_uri"),
    ("file://{root}/a.mp4?x=1", 400, "bad_uri"),
    ("root/a.mp4", 400, "bad_uri"),
    ("a.mp4", 400, "bad_uri"),
    ("{root}/a.mp4\x00.txt", 400, "bad_uri"),
    ("{root}/a\n.mp4", 400, "bad_uri"),
    ("{root}\\..\\outside\\secret.mp4", 400, "bad_uri"),
]


@pytest.mark.parametrize("template,status,code", LOCAL_REFUSALS, ids=[c[0] for c in LOCAL_REFUSALS])
def test_local_refusals(policy, tree, template, status, code):
    uri = template.format(root=tree["root"], out=tree["outside"], tmp=tree["tmp"])
    assert _status(policy, uri) == (status, code)


OTHER_REFUSALS = [
    ("s3://media/other/x.mp4", 403, "outside_roots"),
    ("s3://media/clips-private/x.mp4", 403, "outside_roots"),  # prefix on a '/' boundary only
    ("s3://media/clips", 403, "outside_roots"),  # the prefix itself is not an object under it
    ("s3://media/", 400, "bad_uri"),
    ("s3://elsewhere/clips/x.mp4", 403, "outside_roots"),
    ("s3://media/clips/../secret/x.mp4", 403, "path_traversal"),
    ("s3://media/clips//x.mp4", 400, "bad_uri"),
    ("s3://media/clips/./x.mp4", 400, "bad_uri"),
    ("s3://media/clips/x.mp4?versionId=1", 400, "bad_uri"),
    ("s3://Bad_Bucket/clips/x.mp4", 400, "bad_uri"),
    ("s3://media/clips/x.txt", 415, "not_a_video"),
    ("http://evil.example.org/a.mp4", 403, "host_not_allowed"),
    ("http://videos.example.org:8080/a.mp4", 403, "host_not_allowed"),  # listed without a port = default port only
    ("http://127.0.0.1:8124/a.mp4", 403, "host_not_allowed"),
    ("http://user:pw@videos.example.org/a.mp4", 400, "bad_uri"),
    ("http://videos.example.org.evil.com/a.mp4", 403, "host_not_allowed"),
    ("https://videos.example.org/a/../b.mp4", 403, "path_traversal"),
    ("http://videos.example.org:99999/a.mp4", 400, "bad_uri"),
    ("ftp://videos.example.org/a.mp4", 400, "unsupported_scheme"),
    ("gs://media/clips/a.mp4", 400, "unsupported_scheme"),
    ("data:video/mp4;base64,AAAA", 400, "unsupported_scheme"),
    ("javascript:alert(1)", 400, "unsupported_scheme"),
    ("", 400, "bad_uri"),
    ("   ", 400, "bad_uri"),
    ("/" + "a" * 5000 + ".mp4", 400, "bad_uri"),
]


@pytest.mark.parametrize("uri,status,code", OTHER_REFUSALS, ids=[c[0][:60] for c in OTHER_REFUSALS])
def test_remote_and_malformed_refusals(policy, uri, status, code):
    assert _status(policy, uri) == (status, code)


@pytest.mark.parametrize("value", [None, 5, ["a"], {"a": 1}, b"/x.mp4"])
def test_non_string_uri(policy, value):
    assert _status(policy, value) == (400, "bad_uri")


def test_no_roots_configured_refuses_everything(tree):
    p = UriPolicy([], [], EXTS)
    assert _status(p, str(tree["root"] / "a.mp4")) == (403, "outside_roots")
    assert _status(p, "s3://media/clips/x.mp4") == (403, "outside_roots")
    assert _status(p, "http://videos.example.org/a.mp4") == (403, "host_not_allowed")


def test_bad_root_configuration():
    with pytest.raises(ValueError, match="absolute"):
        UriPolicy(["relative/dir"])
    with pytest.raises(ValueError, match="bucket"):
        UriPolicy(["s3://B!/x"])


def test_errors_are_request_errors_with_messages(policy, tree):
    with pytest.raises(RequestError) as info:
        policy.resolve(str(tree["root"] / "link_out.mp4"))
    assert "not under an allowed root" in info.value.message
    assert str(tree["outside"]) not in info.value.message  # the symlink target is not revealed


# ------------------------------------------------------------------------ reading


def test_local_size_checked_before_reading(policy, tree):
    src = policy.resolve(str(tree["root"] / "a.mp4"))
    with materialize(src, max_bytes=100, timeout_s=5) as path:
        assert path == str(tree["root"] / "a.mp4")
    with pytest.raises(UriError) as info, materialize(src, max_bytes=99, timeout_s=5):
        pass
    assert info.value.status == 413 and "100 bytes" in info.value.message


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/ok.mp4":
            body = b"v" * 1000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/declared-big.mp4":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
            self.wfile.write(b"x" * 10)
        elif self.path == "/undeclared-big.mp4":  # no length: streams until the connection closes
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"y" * 1024)
        elif self.path == "/redirect.mp4":
            self.send_response(302)
            self.send_header("Location", "http://evil.example.org/x.mp4")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()


@pytest.fixture()
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_fetch_with_caps(http_server, tmp_path):
    p = UriPolicy([], [http_server], EXTS)
    src = p.resolve(f"http://{http_server}/ok.mp4")
    with materialize(src, max_bytes=1000, timeout_s=5, tmp_dir=str(tmp_path)) as path:
        assert Path(path).read_bytes() == b"v" * 1000
        assert Path(path).parent == tmp_path
    assert list(tmp_path.iterdir()) == []  # the temp copy is gone
    cases = {"declared-big": 413, "undeclared-big": 413, "redirect": 400, "missing": 404}
    for name, status in cases.items():
        src = p.resolve(f"http://{http_server}/{name}.mp4")
        with pytest.raises(UriError) as info, materialize(src, max_bytes=20_000, timeout_s=5, tmp_dir=str(tmp_path)):
            pass
        assert info.value.status == status, (name, info.value.message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_s3_fetch_with_caps(s3_server, tmp_path):
    import fsspec

    from pipeline.storage import storage_options

    fs = fsspec.filesystem("s3", **storage_options("s3://test"))
    fs.pipe("test/clips/a.mp4", b"s" * 3000)
    fs.pipe("test/private/b.mp4", b"p" * 10)
    p = UriPolicy(["s3://test/clips"], [], EXTS)
    with materialize(p.resolve("s3://test/clips/a.mp4"), max_bytes=3000, timeout_s=10, tmp_dir=str(tmp_path)) as path:
        assert Path(path).read_bytes() == b"s" * 3000
    with pytest.raises(UriError) as info, materialize(p.resolve("s3://test/clips/a.mp4"), 2999, 10, str(tmp_path)):
        pass
    assert info.value.status == 413
    with pytest.raises(UriError) as info, materialize(p.resolve("s3://test/clips/none.mp4"), 3000, 10, str(tmp_path)):
        pass
    assert info.value.status == 404
    assert _status(p, "s3://test/private/b.mp4") == (403, "outside_roots")
    assert list(tmp_path.iterdir()) == []
