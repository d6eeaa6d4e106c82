"""The HTTP server: OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models`; TGI-compatible
`/generate`, `/generate_stream` (and `/`, which TGI's clients post to); `/health`, `/ready`, Prometheus `/metrics`.

Requests never touch an engine: they queue on their model's scheduler (serving/scheduler.py), which batches them.
Every refusal is a JSON error with a status a client can act on (400 context, 401 key, 404 model, 413 body, 422
fields, 429 queue full with Retry-After, 504 timeout); nothing a client sends can take the server down or show
it a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.generation import RETRY_AFTER_S, Finish, Generation, Piece
from serving.metrics import ServerMetrics
from serving.models import ModelRouter, ServedModel
from serving.schemas import ChatRequest, CompletionRequest, GenerateRequest
from serving.text import RequestError, chat_prompt
from tasks.config import ServeConfig

log = logging.getLogger("llmopt.serve")
TGI_DEFAULT_NEW_TOKENS = 100  # TGI's own default when a request names no max_new_tokens


def create_app(router: ModelRouter, settings: ServeConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI application around the served models (their schedulers are closed when it shuts down)."""
    metrics = metrics or ServerMetrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for model in router.models:  # uvicorn has let in-flight requests finish; now stop the workers
            await asyncio.to_thread(model.current.scheduler.close)

    app = FastAPI(title="llmopt server", version="0.2.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_kb * 1024)
    app.add_middleware(RequestMetrics, metrics=metrics)
    _add_error_handlers(app)
    auth = [Depends(api_key_check(os.environ.get(settings.api_key_env) or None))]
    start = _starter(router, settings, metrics)

    @app.get("/health")
    def health() -> dict:
        default = router.models[0]
        return {
            "status": "ok",
            "model": default.served_id,
            "version": default.current.version,
            "variant": default.current.runtime.manifest.name,
            "swap_error": default.last_error,
            "models": [_describe(model) for model in router.models],
        }

    @app.get("/ready")
    def ready() -> JSONResponse:
        down = [model.name for model in router.models if not model.current.scheduler.alive]
        return JSONResponse({"ready": not down, "not_ready": down}, status_code=503 if down else 200)

    @app.get("/metrics")
    def prometheus() -> Response:
        for model in router.models:
            metrics.queue_depth.labels(model.name).set(model.current.scheduler.queued)
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=auth)
    def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": m.name, "object": "model", "owned_by": "llmopt"} for m in router.models],
        }

    @app.post("/v1/completions", dependencies=auth, response_model=None)
    async def completions(body: CompletionRequest, http: Request) -> Any:
        served = router.route(body.model)
        prompt = served.current.runtime.encode(body.prompt)
        generation = start(served, prompt, min(body.max_tokens, settings.max_new_tokens), body)
        shape = _shape("text_completion", served, generation)
        if body.stream:
            return _sse(generation, _openai_chunks(generation, shape, body.include_usage))
        return await _openai_whole(generation, shape, http)

    @app.post("/v1/chat/completions", dependencies=auth, response_model=None)
    async def chat_completions(body: ChatRequest, http: Request) -> Any:
        served = router.route(body.model)
        runtime = served.current.runtime
        prompt = runtime.encode(chat_prompt(runtime.tokenizer, [m.model_dump() for m in body.messages]))
        generation = start(served, prompt, body.token_budget(settings.max_new_tokens), body)
        shape = _shape("chat.completion", served, generation)
        if body.stream:
            return _sse(generation, _openai_chunks(generation, shape, body.include_usage))
        return await _openai_whole(generation, shape, http)

    async def tgi(body: GenerateRequest, http: Request, stream: bool) -> Any:
        served = router.models[0]  # TGI's API names no model: the default one answers
        params = body.parameters
        budget = min(params.max_new_tokens or TGI_DEFAULT_NEW_TOKENS, settings.max_new_tokens)
        prompt = served.current.runtime.encode(body.inputs)
        generation = start(served, prompt, budget, params)
        if stream:
            return _sse(generation, _tgi_events(generation, params.seed), tgi=True)
        return await _tgi_whole(generation, body, http)

    @app.post("/generate", dependencies=auth, response_model=None)
    async def generate(body: GenerateRequest, http: Request) -> Any:
        return await tgi(body, http, stream=False)

    @app.post("/generate_stream", dependencies=auth, response_model=None)
    async def generate_stream(body: GenerateRequest, http: Request) -> Any:
        return await tgi(body, http, stream=True)

    @app.post("/", dependencies=auth, response_model=None)
    async def tgi_compat(body: GenerateRequest, http: Request) -> Any:
        """TGI's route for clients posting to the server's base URL (huggingface_hub's InferenceClient)."""
        answer = await tgi(body, http, stream=body.stream)
        return answer if body.stream else [answer]

    return app


def _starter(router: ModelRouter, settings: ServeConfig, metrics: ServerMetrics) -> Callable[..., Generation]:
    def start(served: ServedModel, prompt: list[int], max_tokens: int, body: Any) -> Generation:
        generation = Generation(
            served, prompt, max_tokens, body.sampling(), body.stops(), settings.request_timeout_s, metrics
        )
        generation.start()
        return generation

    return start


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


# --- OpenAI wire format -----------------------------------------------------------------------------------------


def _shape(kind: str, served: ServedModel, generation: Generation) -> dict:
    """What every OpenAI answer of one request carries: its kind, id, the exact version and the prompt size."""
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {
        "kind": kind,
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "model": f"{served.registered}/{generation.loaded.version}",
        "prompt_tokens": len(generation.prompt),
    }


def _usage(shape: dict, completion_tokens: int) -> dict:
    prompt = shape["prompt_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def _choice(shape: dict, text: str | None, finish: str | None, stream: bool, first: bool = False) -> dict:
    if shape["kind"] == "text_completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
    return {"index": 0, "delta": delta, "finish_reason": finish}


def _envelope(shape: dict, choices: list[dict], stream: bool) -> dict:
    kind = shape["kind"] + (".chunk" if stream and shape["kind"] == "chat.completion" else "")
    return {
        "id": shape["id"],
        "object": kind,
        "created": int(time.time()),
        "model": shape["model"],
        "choices": choices,
    }


async def _openai_whole(generation: Generation, shape: dict, http: Request) -> dict:
    text, finish = [], None
    async for event in generation.events(http.is_disconnected):
        if isinstance(event, Piece):
            text.append(event.text)
        else:
            finish = event
    body = _envelope(shape, [_choice(shape, "".join(text), finish.reason, stream=False)], stream=False)
    return {**body, "usage": _usage(shape, finish.completion_tokens)}


async def _openai_chunks(generation: Generation, shape: dict, include_usage: bool) -> AsyncIterator[dict]:
    first = True
    async for event in generation.events():
        if isinstance(event, Piece):
            if event.text or first:
                yield _envelope(
                    shape, [_choice(shape, event.text, None, stream=True, first=first)], stream=True
                )
                first = False
            continue
        yield _envelope(shape, [_choice(shape, None, event.reason, stream=True)], stream=True)
        if include_usage:
            yield {**_envelope(shape, [], stream=True), "usage": _usage(shape, event.completion_tokens)}


# --- TGI wire format --------------------------------------------------------------------------------------------


async def _tgi_whole(generation: Generation, body: GenerateRequest, http: Request) -> dict:
    tokens, finish = [], None
    async for event in generation.events(http.is_disconnected):
        if isinstance(event, Piece):
            tokens.append(event)
        else:
            finish = event
    text = "".join(piece.text for piece in tokens)
    answer: dict[str, Any] = {
        "generated_text": (body.inputs + text) if body.parameters.return_full_text else text
    }
    if body.parameters.details:
        answer["details"] = {
            **_tgi_details(finish, body.parameters.seed),
            "prefill": [],
            "tokens": [_tgi_token(piece) for piece in tokens if piece.token is not None],
        }
    return answer


async def _tgi_events(generation: Generation, seed: int | None) -> AsyncIterator[dict]:
    text, pending = [], None  # the last token is sent with the final event, which carries the whole text
    async for event in generation.events():
        if isinstance(event, Piece):
            text.append(event.text)
            if event.token is None and pending is not None:  # released tail text rides on the last token
                pending.text += event.text
                continue
            if pending is not None:
                yield {
                    "index": len(text) - 1,
                    "token": _tgi_token(pending),
                    "generated_text": None,
                    "details": None,
                }
            pending = event
            continue
        final = pending or Piece("", generation.loaded.runtime.eos_token_id or 0, 0.0)
        yield {
            "index": len(text),
            "token": _tgi_token(final),
            "generated_text": "".join(text),
            "details": _tgi_details(event, seed),
        }


def _tgi_token(piece: Piece) -> dict:
    return {"id": piece.token, "text": piece.text, "logprob": piece.logprob, "special": False}


def _tgi_details(finish: Finish, seed: int | None) -> dict:
    reason = (
        "stop_sequence" if finish.stop_string else {"stop": "eos_token", "length": "length"}[finish.reason]
    )
    return {"finish_reason": reason, "generated_tokens": finish.completion_tokens, "seed": seed}


# --- transport: SSE, errors, key, body limit, metrics -----------------------------------------------------------


class _CancellingStream(StreamingResponse):
    """A stream whose request is cancelled however the response ends, even before its first byte (a client
    that leaves that early never starts the generator whose cleanup would cancel it)."""

    def __init__(self, generation: Generation, lines: AsyncIterator[str]) -> None:
        super().__init__(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.request.cancel()


def _sse(generation: Generation, events: AsyncIterator[dict], tgi: bool = False) -> StreamingResponse:
    """Server-sent events; an error after the stream has started is sent as a last event in the API's own error
    shape (OpenAI: {"error": {"message", "type", "code"}}; TGI: {"error": message, "error_type": type})."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except RequestError as exc:
            error = (
                {"error": str(exc), "error_type": exc.kind}
                if tgi
                else _error_body(exc.status, str(exc), exc.kind)
            )
            yield f"data: {json.dumps(error)}\n\n"
        if not tgi:
            yield "data: [DONE]\n\n"

    return _CancellingStream(generation, lines())


def _error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, kind), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def refused(_: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return _error(exc.status, str(exc), exc.kind, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}
        return _error(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception(f"{request.method} {request.url.path} failed")  # the traceback stays in the server log
        return _error(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")


def api_key_check(key: str | None) -> Callable[[Request], None]:
    """A dependency refusing requests without `Authorization: Bearer <key>` (no key configured: all pass)."""

    def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise RequestError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error"
            )

    return check


class BodyLimit:
    """Refuses request bodies over `max_bytes` with 413, whether or not they declare their length."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _error(
                413, f"request body over {self.max_bytes} bytes (serve.max_body_kb)", "too_large"
            )(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
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

    ROUTES = {"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/models"}

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
    from tasks.decide.registry import current_version
    from tasks.errors import RegistryError
    from tasks.report.tracking import configure_tracking

    configure_tracking(config.tracking, root)
    settings, metrics, limits = config.serve, ServerMetrics(), Limits.of(config.serve)
    served = []
    for ref in refs:
        name, alias, version = parse_model_ref(ref, config.project.name)
        version = version or current_version(name, alias)
        if version is None:
            raise RegistryError(f"no model version {name}@{alias} in the registry; run `llmopt run` first")
        model = ServedModel(name, alias, load_version(name, version, config.target.threads, limits, metrics))
        if alias and settings.watch_s > 0:
            watch_alias(model, config.target.threads, settings.watch_s, limits, metrics)
        served.append(model)
    app = create_app(ModelRouter(served), settings, metrics)
    # uvicorn lets in-flight requests (streams included) finish on SIGTERM/Ctrl-C before the lifespan shutdown,
    # then raises the signal again under the handler it found: a drained stop is a clean exit (status 0), not a
    # death by SIGTERM's default action (143)
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=settings.request_timeout_s
    )
