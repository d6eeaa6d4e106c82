"""OpenAI's wire API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, answered whole or streamed as
chunks in OpenAI's shapes, and OpenAI's error shape (which every refusal outside a TGI stream takes)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from serving.api.common import require_api_key, sse, start_generation, state_of
from serving.api.openai_protocol import ChatRequest, CompletionRequest, OpenAISampling
from serving.generation import Generation, Piece
from serving.models import ServedModel
from serving.text import RequestError, chat_prompt

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
def models(http: Request) -> dict:
    served = state_of(http).model_router.models
    return {
        "object": "list",
        "data": [{"id": m.name, "object": "model", "owned_by": "llmopt"} for m in served],
    }


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, http: Request) -> Any:
    state = state_of(http)
    served = state.model_router.route(body.model)
    prompt = served.current.runtime.encode(body.prompt)
    budget = min(body.max_tokens, state.settings.max_new_tokens)
    generation = start_generation(http, served, prompt, budget, body)
    return await _answer(generation, _shape("text_completion", served, generation), body, http)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, http: Request) -> Any:
    state = state_of(http)
    served = state.model_router.route(body.model)
    runtime = served.current.runtime
    prompt = runtime.encode(chat_prompt(runtime.tokenizer, [m.model_dump() for m in body.messages]))
    budget = body.token_budget(state.settings.max_new_tokens)
    generation = start_generation(http, served, prompt, budget, body)
    return await _answer(generation, _shape("chat.completion", served, generation), body, http)


def error_body(status: int, message: str, kind: str) -> dict:
    """OpenAI's error shape, the one every refusal takes but an error inside a TGI stream."""
    return {"error": {"message": message, "type": kind, "code": status}}


def _error_event(exc: RequestError) -> dict:
    return error_body(exc.status, str(exc), exc.kind)


async def _answer(generation: Generation, shape: dict, body: OpenAISampling, http: Request) -> Any:
    if body.stream:
        return sse(generation, _chunks(generation, shape, body.include_usage), _error_event, done="[DONE]")
    return await _whole(generation, shape, http)


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


async def _whole(generation: Generation, shape: dict, http: Request) -> dict:
    text, finish = [], None
    async for event in generation.events(http.is_disconnected):
        if isinstance(event, Piece):
            text.append(event.text)
        else:
            finish = event
    body = _envelope(shape, [_choice(shape, "".join(text), finish.reason, stream=False)], stream=False)
    return {**body, "usage": _usage(shape, finish.completion_tokens)}


async def _chunks(generation: Generation, shape: dict, include_usage: bool) -> AsyncIterator[dict]:
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
