"""OpenAI's wire API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, answered whole or streamed as
chunks in OpenAI's shapes, one choice per prompt and per `n`, and OpenAI's error shape (which every refusal off
TGI's routes takes)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request

from serving.api.common import require_api_key, sse, start_generation, state_of
from serving.api.openai_protocol import ChatRequest, CompletionRequest, OpenAISampling
from serving.api.registry import WireApi, register_api
from serving.generation import Finish, Generation, Piece, PromptScores
from serving.models import ServedModel
from serving.text import RequestError, chat_prompt, encode_prompt

router = APIRouter(dependencies=[Depends(require_api_key)])


@dataclass
class Choice:
    """One choice of an answer: its index, its generation and the text put before it (`echo`)."""

    index: int
    generation: Generation
    echo: str = ""


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
    runtime = served.current.runtime
    vocabulary = len(runtime.tokenizer)
    budget = min(body.max_tokens, state.settings.max_new_tokens)
    prompts = []
    for prompt in body.prompt:
        ids = await encode_prompt(runtime, prompt, budget) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= token < vocabulary for token in ids):
            raise RequestError(
                400, f"prompt: token ids must lie in 0..{vocabulary - 1} (this model's vocabulary)"
            )
        echo = (prompt if isinstance(prompt, str) else runtime.decode(ids)) if body.echo else ""
        prompts.append((ids, echo))
    choices = _start(http, served, prompts, budget, body)
    return await _answer(choices, _shape("text_completion", served, choices, body), body, http)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, http: Request) -> Any:
    state = state_of(http)
    served = state.model_router.route(body.model)
    runtime = served.current.runtime
    budget = body.token_budget(state.settings.max_new_tokens)
    text = chat_prompt(runtime.tokenizer, [m.template_message() for m in body.messages])
    prompt = await encode_prompt(runtime, text, budget)
    choices = _start(http, served, [(prompt, "")], budget, body)
    return await _answer(choices, _shape("chat.completion", served, choices, body), body, http)


def _start(
    http: Request,
    served: ServedModel,
    prompts: list[tuple[list[int], str]],
    budget: int,
    body: OpenAISampling,
) -> list[Choice]:
    """`n` choices per prompt, queued together (the scheduler batches them); a seeded request's choices draw
    from seeds `seed`, `seed + 1`, … so they differ. A refusal of any (429) withdraws the ones already queued."""
    wanted, room = len(prompts) * body.n, served.current.scheduler.max_queue
    if wanted > room:
        raise RequestError(
            400,
            f"{len(prompts)} prompt(s) × n {body.n} = {wanted} generations, more than this server queues at once "
            f"({room}, serve.max_queue); send fewer per request",
        )
    choices: list[Choice] = []
    sampling = body.sampling()
    try:
        for ids, echo in prompts:
            for draw in range(body.n):
                seed = None if sampling.seed is None else sampling.seed + draw
                own = dataclasses.replace(sampling, seed=seed)
                generation = start_generation(http, served, ids, budget, body, own)
                choices.append(Choice(len(choices), generation, echo))
    except RequestError:
        for choice in choices:
            choice.generation.request.cancel()
        raise
    return choices


def error_body(status: int, message: str, kind: str) -> dict:
    """OpenAI's error shape, the one every refusal off TGI's routes takes."""
    return {"error": {"message": message, "type": kind, "code": status}}


def _error_event(exc: RequestError) -> dict:
    return error_body(exc.status, str(exc), exc.kind)


async def _answer(choices: list[Choice], shape: dict, body: OpenAISampling, http: Request) -> Any:
    if body.stream:
        generations = [choice.generation for choice in choices]
        return sse(generations, _chunks(choices, shape, body.include_usage), _error_event, done="[DONE]")
    return await _whole(choices, shape, http)


def _shape(kind: str, served: ServedModel, choices: list[Choice], body: OpenAISampling) -> dict:
    """What every OpenAI answer of one request carries: its kind, id, the exact version, the prompts' size (each
    prompt once, however many choices it has) and whether log-probabilities were asked for."""
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    first = choices[0].generation
    return {
        "kind": kind,
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "model": f"{served.registered}/{first.loaded.version}",
        "prompt_tokens": sum(len(choice.generation.prompt) for choice in choices[:: body.n]),
        "tokenizer": first.loaded.runtime.tokenizer,
        "logprobs": body.token_logprobs,
    }


def _usage(shape: dict, completion_tokens: int) -> dict:
    prompt = shape["prompt_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def _logprobs(shape: dict, pieces: list[Piece], offset: int = 0) -> dict | None:
    """The tokens' log-probabilities in the endpoint's shape (None when the request did not ask)."""
    if not shape["logprobs"]:
        return None
    tokenizer = shape["tokenizer"]
    pieces = [piece for piece in pieces if piece.token is not None]
    texts = [tokenizer.decode([piece.token]) for piece in pieces]
    if shape["kind"] == "text_completion":
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [piece.logprob for piece in pieces],
            "top_logprobs": [
                None
                if piece.logprob is None  # the prompt's first token: no context, no distribution
                else {tokenizer.decode([token]): logprob for token, logprob in piece.top or []}
                for piece in pieces
            ],
            "text_offset": offsets,
        }
    return {
        "content": [
            {
                **_chat_logprob(text, piece.logprob),
                "top_logprobs": [
                    _chat_logprob(tokenizer.decode([token]), logprob) for token, logprob in piece.top or []
                ],
            }
            for text, piece in zip(texts, pieces, strict=True)
        ]
    }


def _prompt_pieces(scores: PromptScores) -> list[Piece]:
    return [Piece("", token, logprob, top) for token, logprob, top in scores.entries]


def _chat_logprob(text: str, logprob: float | None) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _choice(
    shape: dict,
    index: int,
    text: str | None,
    finish: str | None,
    stream: bool,
    first: bool = False,
    logprobs: dict | None = None,
) -> dict:
    if shape["kind"] == "text_completion":
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if not stream:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _envelope(shape: dict, choices: list[dict], stream: bool) -> dict:
    kind = shape["kind"] + (".chunk" if stream and shape["kind"] == "chat.completion" else "")
    return {
        "id": shape["id"],
        "object": kind,
        "created": int(time.time()),
        "model": shape["model"],
        "choices": choices,
    }


async def _whole(choices: list[Choice], shape: dict, http: Request) -> dict:
    async def one(choice: Choice) -> tuple[dict, int]:
        prompt, pieces, finish = [], [], None
        async for event in choice.generation.events(http.is_disconnected):
            if isinstance(event, Piece):
                pieces.append(event)
            elif isinstance(event, PromptScores):
                prompt = _prompt_pieces(event)
            else:
                finish = event
        text = choice.echo + "".join(piece.text for piece in pieces)
        logprobs = _logprobs(shape, prompt + pieces) if prompt else _logprobs(shape, pieces, len(choice.echo))
        return _choice(
            shape, choice.index, text, finish.reason, False, logprobs=logprobs
        ), finish.completion_tokens

    tasks = [asyncio.ensure_future(one(choice)) for choice in choices]
    try:
        answers = await asyncio.gather(*tasks)
    finally:  # one choice failing (or the client leaving) ends the others too, and their errors are collected
        for choice in choices:
            choice.generation.request.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    body = _envelope(shape, [answer for answer, _ in answers], stream=False)
    return {**body, "usage": _usage(shape, sum(tokens for _, tokens in answers))}


async def _chunks(choices: list[Choice], shape: dict, include_usage: bool) -> AsyncIterator[dict]:
    tokenizer = shape["tokenizer"]
    first = {choice.index: True for choice in choices}
    waiting: dict[int, list[Piece]] = {
        choice.index: [] for choice in choices
    }  # tokens whose text is held back
    offset = {choice.index: len(choice.echo) for choice in choices}
    echoes = {choice.index: choice.echo for choice in choices}
    for choice in choices:
        if choice.echo and not shape["logprobs"]:  # with logprobs the echo waits for the prompt's scores
            yield _envelope(shape, [_choice(shape, choice.index, choice.echo, None, True)], stream=True)
    produced = 0
    async for index, event in _merged(choices):
        if isinstance(event, PromptScores):
            prompt = _prompt_pieces(event)
            logprobs = _logprobs(shape, prompt)
            yield _envelope(
                shape, [_choice(shape, index, echoes[index], None, True, logprobs=logprobs)], stream=True
            )
            offset[index] = sum(len(tokenizer.decode([piece.token])) for piece in prompt)
            continue
        if isinstance(event, Piece):
            waiting[index].append(event)
            if event.text or first[index]:
                logprobs = _logprobs(shape, waiting[index], offset[index])
                choice = _choice(shape, index, event.text, None, True, first=first[index], logprobs=logprobs)
                yield _envelope(shape, [choice], stream=True)
                offset[index] += sum(
                    len(tokenizer.decode([p.token])) for p in waiting[index] if p.token is not None
                )
                first[index], waiting[index] = False, []
            continue
        logprobs = _logprobs(shape, waiting[index], offset[index]) if waiting[index] else None
        yield _envelope(
            shape, [_choice(shape, index, None, event.reason, True, logprobs=logprobs)], stream=True
        )
        produced += event.completion_tokens
    if include_usage:
        yield {**_envelope(shape, [], stream=True), "usage": _usage(shape, produced)}


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple[int, Piece | PromptScores | Finish]]:
    """The choices' events as they come, each with its choice's index; a choice's error ends them all."""
    if len(choices) == 1:  # the common case: no tasks in between
        async for event in choices[0].generation.events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for event in choice.generation.events():
                await queue.put((choice.index, event))
        except RequestError as exc:
            await queue.put((choice.index, exc))
        except Exception as exc:  # anything else ends the stream too, in the API's error shape, never a hang
            await queue.put(
                (choice.index, RequestError(500, f"generation failed: {type(exc).__name__}", "server_error"))
            )
        finally:
            queue.put_nowait((choice.index, None))

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        left = len(tasks)
        while left:
            index, event = await queue.get()
            if event is None:
                left -= 1
            elif isinstance(event, RequestError):
                raise event
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        for choice in choices:
            choice.generation.request.cancel()


register_api(WireApi("openai", router, error_body, default=True))
