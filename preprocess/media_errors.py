"""`MediaError`: why a video cannot be used (its `kind`) and what is wrong (its message).

Its own module so that `preprocess/media.py` and `preprocess/timing.py` (which media.py
imports) both import it without an import circle; `preprocess.media.MediaError` is the same class.
"""

from __future__ import annotations


class MediaError(ValueError):
    """A video cannot be used; `kind` names the failure class, the message explains it."""

    KINDS = ("missing", "empty", "too_large", "not_media", "truncated", "no_video", "undecodable", "annotation",
             "bad_timing")

    def __init__(self, reason: str, kind: str = "undecodable"):
        if kind not in self.KINDS:
            raise ValueError(f"unknown MediaError kind {kind!r}")
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
