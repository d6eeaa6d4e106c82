"""The HTTP server: the app around the served models, with OpenAI's and TGI's wire APIs (serving/api/) included
beside `/health`, `/ready` and Prometheus `/metrics`, and the transport every route shares: errors, body limit,
request metrics.

Requests never touch an engine: they queue on their model's scheduler (serving/scheduler.py), which batches them.
Every refusal is a JSON error with a status a client can act on (400 context, 401 key, 404 model, 413 body, 422
fields, 429 queue full with Retry-After, 504 timeout); nothing a client sends can take the server down or show
it a traceback."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api import catalog as wire_apis
from serving.api.common import ServerState, state_of
from serving.api.registry import error_shape
from serving.generation import RETRY_AFTER_S
from serving.metrics import ServerMetrics
from serving.models import ModelRouter, ServedModel
from serving.text import RequestError
from tasks.config import ServeConfig

log = logging.getLogger("llmopt.serve")
_operations = APIRouter()  # what operators and orchestrators ask: no API key


def create_app(router: ModelRouter, settings: ServeConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI application around the served models (their schedulers are closed when it shuts down)."""
    metrics = metrics or ServerMetrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for model in router.models:  # uvicorn has let in-flight requests finish; now stop the workers
            await asyncio.to_thread(model.current.scheduler.close)

    app = FastAPI(title="llmopt server", version="0.2.0", lifespan=lifespan)
    app.state.server = ServerState(router, settings, metrics, os.environ.get(settings.api_key_env) or None)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_kb * 1024,
        timeout_s=settings.body_timeout_s,
        bytes_per_s=settings.body_mb_per_s * 1e6,
    )
    app.add_middleware(RequestMetrics, metrics=metrics)
    _add_error_handlers(app)
    app.include_router(_operations)
    for api in wire_apis.load().values():  # OpenAI's, TGI's and any plug-in's (serving/api/registry.py)
        app.include_router(api.router)
    return app


@_operations.get("/health")
def health(http: Request) -> dict:
    models = state_of(http).model_router.models
    default = models[0]
    return {
        "status": "ok",
        "model": default.served_id,
        "version": default.current.version,
        "variant": default.current.runtime.manifest.name,
        "swap_error": default.last_error,
        "models": [_describe(model) for model in models],
    }


@_operations.get("/ready")
def ready(http: Request) -> JSONResponse:
    down = [model.name for model in state_of(http).model_router.models if not model.current.scheduler.alive]
    return JSONResponse({"ready": not down, "not_ready": down}, status_code=503 if down else 200)


@_operations.get("/metrics")
def prometheus(http: Request) -> Response:
    state = state_of(http)
    for model in state.model_router.models:
        state.metrics.queue_depth.labels(model.name).set(model.current.scheduler.queued)
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")


def _describe(model: ServedModel) -> dict:
    return {
        "id": model.name,
        "served_id": model.served_id,
        "version": model.current.version,
        "variant": model.current.runtime.manifest.name,
        "engine": model.current.runtime.manifest.engine,
        "queued": model.current.scheduler.queued,
        "in_flight": model.current.scheduler.in_flight,
        "swap_error": model.last_error,
    }


# --- transport: errors, body limit, metrics ---------------------------------------------------------------------


def _error(
    status: int, message: str, kind: str, headers: dict | None = None, path: str | None = None
) -> JSONResponse:
    """A refusal in the shape of the API asked: TGI's on TGI's routes, OpenAI's everywhere else."""
    return JSONResponse(error_shape(path)(status, message, kind), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return _error(exc.status, str(exc), exc.kind, headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, validation_message(exc.errors()), "invalid_request_error", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large"}
        kind = kinds.get(exc.status_code, "invalid_request_error")
        return _error(exc.status_code, str(exc.detail), kind, path=request.url.path)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception(f"{request.method} {request.url.path} failed")  # the traceback stays in the server log
        message = f"internal error ({type(exc).__name__}); see the server log"
        return _error(500, message, "server_error", path=request.url.path)


def validation_message(errors: Any) -> str:
    """One line naming every field a request body got wrong: `parameters.watermark: …; messages.0.role: …`."""
    lines = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "not a field this API takes"
        lines.append(f"{where}: {message}" if where else message)
    return "; ".join(lines) or "invalid request body"


class BodyLimit:
    """Refuses request bodies over `max_bytes` with 413, whether or not they declare their length, and bodies
    still incomplete `timeout_s` after they began with 408; reads what bodies carry beyond their first
    `FREE_BYTES` at `bytes_per_s` at most, all requests together, first come first served (0: no limit)."""

    FREE_BYTES = 64 * 1024

    def __init__(self, app: Any, max_bytes: int, timeout_s: float = 30.0, bytes_per_s: float = 0.0) -> None:
        self.app, self.max_bytes, self.timeout_s, self.bytes_per_s = app, max_bytes, timeout_s, bytes_per_s
        self._next_free = 0.0  # when the shared read allowance is next available (time.monotonic)

    async def _paced(self, size: int, deadline: float) -> bool:
        """Wait for `size` bytes of the shared allowance (reserved in arrival order); False, reserving nothing,
        when that wait would pass `deadline` (the body is then refused as too slow)."""
        now = time.monotonic()
        start = max(now, self._next_free)
        if start > deadline:
            return False
        self._next_free = start + size / self.bytes_per_s
        if start > now:
            await asyncio.sleep(start - now)
        return True

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _error(
                413,
                f"request body over {self.max_bytes} bytes (serve.max_body_kb)",
                "too_large",
                path=scope["path"],
            )(scope, receive, send)
        seen, deadline, complete = 0, None, False

        async def counted() -> dict:
            nonlocal seen, deadline, complete
            if complete:  # the body is in: what follows (a disconnect, while a stream runs) has no deadline
                return await receive()
            deadline = deadline or time.monotonic() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise StarletteHTTPException(
                    408, f"request body not complete within {self.timeout_s:g} s (serve.body_timeout_s)"
                ) from None
            complete = message.get("type") != "http.request" or not message.get("more_body", False)
            size = len(message.get("body", b""))
            if self.bytes_per_s and seen + size > self.FREE_BYTES:
                wait = await self._paced(min(size, seen + size - self.FREE_BYTES), deadline)
                if not wait:
                    raise StarletteHTTPException(
                        408, f"request body not complete within {self.timeout_s:g} s (serve.body_timeout_s)"
                    )
            seen += size
            if (
                seen > self.max_bytes
            ):  # FastAPI passes HTTPException through its body parsing (others become 400)
                raise StarletteHTTPException(
                    413, f"request body over {self.max_bytes} bytes (serve.max_body_kb)"
                )
            return message

        await self.app(scope, counted, send)


class RequestMetrics:
    """Counts every request by route and status and times it until its last byte is sent (streams included)."""

    ROUTES = {
        "/",
        "/generate",
        "/generate_stream",
        "/info",
        "/tokenize",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
    }

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.ROUTES else "other"
        started, status = time.monotonic(), [500]

        async def timed(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.metrics.requests.labels(route, str(status[0])).inc()
                self.metrics.latency.labels(route).observe(time.monotonic() - started)

        try:
            await self.app(scope, receive, timed)
        except Exception:  # answered by the server-error handler outside this middleware: count it here
            self.metrics.requests.labels(route, "500").inc()
            self.metrics.latency.labels(route).observe(time.monotonic() - started)
            raise


def serve_registered_models(config: Any, root: Any, refs: list[str], host: str, port: int) -> None:
    """Serve registered models (`serve.models` entries) with uvicorn, following each alias when it moves."""
    import uvicorn

    from serving.models import Limits, load_version, parse_model_ref, watch_alias
    from tasks.decide.model_registry import current_version
    from tasks.errors import RegistryError
    from tasks.report.tracking import configure_tracking

    configure_tracking(config.tracking, root)
    show_own_logs()
    keep_freed_memory()
    settings, metrics, limits = config.serve, ServerMetrics(), Limits.of(config.serve)
    served = []
    for ref in refs:
        name, alias, version = parse_model_ref(ref, config.project.name)
        version = version or current_version(name, alias)
        if version is None:
            raise RegistryError(f"no model version {name}@{alias} in the registry; run `llmopt run` first")
        model = ServedModel(name, alias, load_version(name, version, config.target, limits, metrics))
        if alias and settings.watch_s > 0:
            watch_alias(model, config.target, settings.watch_s, limits, metrics)
        served.append(model)
    app = create_app(ModelRouter(served), settings, metrics)
    # what is loaded by now lives as long as the server: out of the collector's way, so that a full collection
    # scans only what requests make (over every imported module and the loaded models, one took ~0.2 s, a pause
    # of every stream and of the scheduler's worker alike)
    gc.collect()
    gc.freeze()
    # uvicorn lets in-flight requests (streams included) finish on SIGTERM/Ctrl-C before the lifespan shutdown,
    # then raises the signal again under the handler it found: a drained stop is a clean exit (status 0), not a
    # death by SIGTERM's default action (143)
    signal.signal(signal.SIGTERM, lambda *_: None)
    if not _loopback(host) and not os.environ.get(settings.api_key_env):
        log.warning(
            f"serving on {host}, reachable from other machines, with no API key: anyone who can connect may use "
            f"it (set ${settings.api_key_env} to require one)"
        )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=settings.request_timeout_s,
        limit_concurrency=settings.max_connections,
    )


def show_own_logs() -> None:
    """llmopt's own log lines on the console at INFO, in uvicorn's format beside its lines: what a loaded version
    runs on (the prompt paths measured at its first decoder, compiled buckets), alias moves, warnings. Without a
    handler only warnings reached the console, and the rest was lost."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    for name in ("tasks", "llmopt"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False  # (a handler of the root's would print each line twice)


def keep_freed_memory() -> None:
    """Have glibc keep the memory the engines free for their next call instead of handing it back to the kernel:
    blocks up to 32 MB come from the heap rather than their own mappings, and the heap is trimmed only beyond 1 GB
    free. Each prompt call allocates its activations afresh; given back, they were taken again page by page on the
    next call. Measured on a 2-core VM (one run each, different bursts): a 16-request burst's bfloat16 prompt call
    took 7 700-19 000 page faults and ~0.5 s for 900-1 200 tokens, with this ~550 faults and 0.39 s for 880; the
    c16 TTFT p95 of a fresh server 628-637 ms before, 506-570 after (docs/results/2026-12-06-serving-memory.md).
    The process keeps its peak instead (a server's steady state). Nothing where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    mallopt(m_mmap_threshold, 32 << 20)  # the largest glibc takes
    mallopt(m_trim_threshold, 1 << 30)


def _loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
