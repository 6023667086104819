"""OpenAI-shaped errors for every HTTP failure (the openai client reads `error.message`), and the middlewares that
produce them: typed errors -> status codes, API keys, the sealed-only mode."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from glm5.errors import CapacityError, DeadlineError, InvalidRequestError, UnavailableError, bounded
from glm5.security import Secret, any_matches, bearer

from glm5_router.scheduling.dispatcher import WorkerStatusError

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# probes and the API's description need no API key; /metrics only with --public-metrics (docs/security.md)
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
AUTHENTICATED = "glm5.authenticated"  # request key: the caller presented a valid API key


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        message = bounded(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", "invalid_request_error", field)


def to_api_error(exc: BaseException, retry_after_s: int = 1) -> ApiError:
    """Typed errors -> OpenAI-style errors with the HTTP status a client can act on."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        if exc.field == "model":
            return ApiError(404, str(exc), "invalid_request_error", "model", "model_not_found")
        return ApiError(400, str(exc), "invalid_request_error", exc.field)
    if isinstance(exc, WorkerStatusError):
        return ApiError(400, exc.details, "invalid_request_error")
    if isinstance(exc, CapacityError):
        return ApiError(429, str(exc), "rate_limit_error", headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, DeadlineError):
        return ApiError(408, str(exc), "timeout_error")
    if isinstance(exc, UnavailableError):
        return ApiError(503, str(exc), "service_unavailable", headers={"Retry-After": str(retry_after_s)})
    log.exception("unexpected error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error")


def _http_error(exc: web.HTTPException, request: web.Request, max_body: int) -> ApiError:
    """aiohttp's own 4xx (no route, wrong method, body too large) as OpenAI-shaped JSON."""
    headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
    if exc.status == 404:
        return ApiError(404, f"no such endpoint: {request.method} {request.path}", "invalid_request_error",
                        code="not_found")  # fmt: skip
    if exc.status == 405:
        return ApiError(405, f"{request.method} is not allowed on {request.path} (allowed: "
                        f"{exc.headers.get('Allow', '')})", "invalid_request_error", code="method_not_allowed",
                        headers=headers)  # fmt: skip
    if exc.status == 413:
        return ApiError(413, f"request body larger than {max_body >> 20} MiB", "invalid_request_error")
    return ApiError(exc.status, exc.reason, "invalid_request_error" if exc.status < 500 else "server_error",
                    headers=headers)  # fmt: skip


def errors_middleware(max_body: int) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (request.content_length or 0) > max_body:  # from the header alone: a client need not send the body
            too_large = ApiError(413, f"request body larger than {max_body >> 20} MiB", "invalid_request_error")
            refused = too_large.response()
            refused.force_close()  # the unread body must not be taken for the next request
            return refused
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _http_error(exc, request, max_body).response()
        except Exception as exc:
            return to_api_error(exc).response()

    return middleware


def auth_middleware(keys: Sequence[Secret], open_paths: Collection[str] = OPEN_PATHS) -> Middleware:
    """`Authorization: Bearer <key>` on every path but `open_paths`; 401 as OpenAI answers a bad key."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[AUTHENTICATED] = any_matches(keys, bearer(request.headers.get("Authorization")))
        if request.path not in open_paths and not request[AUTHENTICATED]:
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        return await handler(request)

    return middleware


def sealed_only_middleware(allowed: frozenset[str]) -> Middleware:
    """--require-sealed: the HTTP API carries prompts in the clear, so only `allowed` paths stay."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in allowed:
            raise ApiError(403, "this router serves only SM4-sealed requests, on its gRPC API (--require-sealed)",
                           "permission_error", code="sealed_only")  # fmt: skip
        return await handler(request)

    return middleware
