"""The HTTP API of the captioning service (FastAPI), independent of Ray.

    app = build_app(lambda: service)        # plain: uvicorn.run(app, host="127.0.0.1")
    infer/serving/deployment.py: build_app(<the replica's servable object>) under @serve.ingress

Routes (OpenAPI schema at /openapi.json, docs at /docs):
    POST /v1/captions   application/json {"video": "<uri>", "options": {...}}
                        or multipart/form-data with `file` (the video) and optional
                        `options` (a JSON object as text)
                        -> {"video_id", "duration", "events": [{"start","end","caption"}],
                            "timings": {...}, "model"}
    GET  /healthz       liveness (503 after a device fault), engine builds, request counters
    GET  /v1/model      model id, config hash, decoding settings, limits

Errors are JSON `{"error": {"code", "message", "request_id"}}`: 4xx for anything
the client sent (malformed JSON, wrong types, unknown options, URIs outside the
roots, too large/long files, non-videos, ...), 500 only for server bugs (the
message then carries nothing but the request id, which is in the log with the
traceback). Every response has an X-Request-ID header. The body is never read
whole: JSON is capped at serve.max_json_bytes, uploads stream to a temp file
capped at serve.max_upload_bytes (a larger declared Content-Length is refused
before reading).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from infer.serving.bodies import UploadLimits, declared_length, parse_json, read_json, receive_upload
from infer.serving.errors import RequestError
from infer.serving.protocol import CaptionRequest, CaptionResponse, ErrorResponse, error_message
from infer.serving.service import CaptionService

log = logging.getLogger("padcap.serve")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

_UPLOAD_SCHEMA = {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "the video file"},
        "options": {"type": "string", "description": "optional JSON object with CaptionOptions fields"},
    },
}
_ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in {
    400: "malformed request (JSON syntax, multipart framing, empty file, bad URI)",
    403: "the URI is outside the allowed roots / hosts",
    404: "the named file does not exist",
    413: "the file (or the declared body) is over serve.max_upload_bytes",
    415: "unsupported Content-Type or not a video file",
    422: "invalid fields or options, or a video that cannot be decoded or is over the limits",
    500: "server bug (quote the request id)",
    503: "overloaded (Ray Serve back-pressure): retry later",
}.items()}


def request_id(request: Request) -> str:
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        given = request.headers.get("x-request-id", "")
        rid = given if _CLIENT_ID.match(given) else uuid.uuid4().hex[:16]
        request.state.request_id = rid
    return rid


def error_response(request: Request, status: int, code: str, message: str) -> JSONResponse:
    rid = request_id(request)
    return JSONResponse({"error": {"code": code, "message": message, "request_id": rid}},
                        status_code=status, headers={"X-Request-ID": rid})


def build_app(get_service: Callable[[], CaptionService]) -> FastAPI:
    """The FastAPI app; `get_service()` returns the CaptionService that handles each request."""
    app = FastAPI(title="PadCaptioner", version="1", description="Dense omni-modal video captioning: events with start, end and caption.")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "no_such_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(request, exc.status_code, code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(request, 422, "invalid_request", msg)

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        body = get_service().health()  # 503 once the engine hit a device fault (the replica is being replaced)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503, headers={"X-Request-ID": request_id(request)})

    @app.get("/v1/model")
    async def model(request: Request) -> JSONResponse:
        return JSONResponse(get_service().model_info(), headers={"X-Request-ID": request_id(request)})

    @app.post(
        "/v1/captions",
        response_model=CaptionResponse,
        responses=_ERRORS,
        summary="Caption a video: events with start, end and caption",
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/CaptionRequest"}},
            "multipart/form-data": {"schema": _UPLOAD_SCHEMA},
        }}},
    )
    async def captions(request: Request) -> JSONResponse:
        rid = request_id(request)
        try:
            body = await _caption(get_service(), request)
        except RequestError as e:
            log.info("request %s refused: %s %s: %s", rid, e.status, e.code, e.message)
            return error_response(request, e.status, e.code, e.message)
        except ClientDisconnect:
            log.info("request %s: client disconnected while sending the body", rid)
            return error_response(request, 400, "client_disconnected", "the client disconnected before the request body was complete")
        except Exception:
            log.exception("request %s failed", rid)
            return error_response(request, 500, "internal", f"internal error; request id {rid}")
        return JSONResponse(body, headers={"X-Request-ID": rid})

    def openapi() -> dict[str, Any]:  # FastAPI's schema, with CaptionRequest (the JSON body) in its components
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            req = CaptionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(req.pop("$defs", {}))
            components["CaptionRequest"] = req
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _caption(service: CaptionService, request: Request) -> dict[str, Any]:
    cfg = service.serve_cfg
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    declared = declared_length(request.headers.get("content-length"))
    if media == "application/json":
        obj = await read_json(request.stream(), declared, cfg.max_json_bytes)
        if not isinstance(obj, dict):
            raise RequestError(422, "invalid_request", f"the JSON body must be an object like {{\"video\": \"<uri>\"}}, got {type(obj).__name__}")
        try:
            req = CaptionRequest.model_validate(obj)
        except ValidationError as e:
            raise RequestError(422, "invalid_request", error_message(e)) from None
        return await service.caption_uri(req.video, req.options)
    if media == "multipart/form-data":
        limits = UploadLimits(cfg.max_upload_bytes, cfg.max_json_bytes, cfg.upload_dir or None,
                              tuple(e.lower() for e in service.cfg.data.video_extensions))
        form = await receive_upload(request.stream(), content_type, declared, limits)
        try:
            options = None
            if form.options_text is not None and form.options_text.strip():
                options = parse_json(form.options_text.encode("utf-8"), "the 'options' field")
            return await service.caption_file(form.path, form.filename, options)
        finally:
            form.cleanup()
    if not media:
        raise RequestError(415, "unsupported_media_type", "missing Content-Type: send application/json or multipart/form-data")
    raise RequestError(415, "unsupported_media_type", f"Content-Type {media[:80]!r} is not supported: send application/json "
                       "({\"video\": \"<uri>\"}) or multipart/form-data (field 'file')")
