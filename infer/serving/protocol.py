"""The serving API's wire format: pydantic models for requests, options and responses.

Requests are strict: unknown keys are refused (extra="forbid") and types are not
coerced (strict=True: "5" is not an int, true is not an int), so a client learns
exactly which field was wrong. `error_message(exc)` turns a pydantic
ValidationError into one readable line ("options.max_events: Input should be
greater than or equal to 1"). Used by infer/serving/service.py, infer/serving/api.py and
infer/serving/client.py. Pure python.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_OPTION_EVENTS = 1000
MAX_OPTION_BRANCH_TOKENS = 4096


class CaptionOptions(BaseModel):
    """Per-request decoding options; each one left out takes the server's infer.* value.

    max_events and max_branch_tokens may only lower the server's own limits.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    max_events: int | None = Field(None, ge=1, le=MAX_OPTION_EVENTS, description="at most this many events (<= the server's infer.max_events)")
    max_branch_tokens: int | None = Field(None, ge=1, le=MAX_OPTION_BRANCH_TOKENS, description="caption tokens per event (<= the server's infer.max_branch_tokens)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass")
    seed: int | None = Field(None, ge=0, le=2**31 - 1, description="sampling seed")

    def overrides(self) -> dict[str, Any]:
        """The options that were set, as infer.* overrides."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class CaptionRequest(BaseModel):
    """JSON body of POST /v1/captions: a video URI under the server's allowed roots."""

    model_config = ConfigDict(extra="forbid", strict=True)

    video: str = Field(..., min_length=1, max_length=4096, description="absolute path, file://, s3://bucket/key or an allowed http(s) URL")
    options: CaptionOptions = Field(default_factory=CaptionOptions)


class EventOut(BaseModel):
    start: float = Field(..., description="seconds")
    end: float = Field(..., description="seconds")
    caption: str
    capped: bool = Field(False, description="the caption was cut at infer.max_branch_tokens (no end-of-text)")


class CaptionResponse(BaseModel):
    video_id: str
    duration: float = Field(..., description="seconds")
    events: list[EventOut]
    timings: dict[str, float] = Field(..., description="seconds per stage (fetch, probe, features, decode, total, and the engine's own)")
    model: str
    segments_kept: int = Field(0, description="time segments the model saw (fewer than segments_total: a long video shortened to fit)")
    segments_total: int = Field(0, description="time segments of the video")


class ErrorDetail(BaseModel):
    code: str
    message: str
    request_id: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_message(exc: ValidationError, prefix: str = "") -> str:
    """A pydantic ValidationError as one line naming each bad field."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not allowed)"
        parts.append(f"{loc or 'body'}: {msg}")
    return "; ".join(parts[:10]) + (f"; and {len(parts) - 10} more" if len(parts) > 10 else "")
