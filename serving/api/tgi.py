"""TGI's wire API: `/generate`, `/generate_stream` and `/` (where TGI's clients post to a base URL), `/info` and
`/tokenize`, answered with TGI's tokens and details, and TGI's error shape for every refusal on these routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from serving.api.common import require_api_key, sse, start_generation, state_of
from serving.api.registry import WireApi, register_api
from serving.api.tgi_protocol import GenerateRequest, TokenizeRequest
from serving.generation import Finish, Generation, Piece, PromptScores
from serving.text import RequestError, encode_prompt

TGI_DEFAULT_NEW_TOKENS = 100  # TGI's own default when a request names no max_new_tokens

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, http: Request) -> Any:
    return await _answer(body, http, stream=False)


@router.post("/generate_stream", response_model=None)
async def generate_stream(body: GenerateRequest, http: Request) -> Any:
    return await _answer(body, http, stream=True)


@router.post("/", response_model=None)
async def tgi_compat(body: GenerateRequest, http: Request) -> Any:
    """TGI's route for clients posting to the server's base URL (huggingface_hub's InferenceClient)."""
    answer = await _answer(body, http, stream=body.stream)
    return answer if body.stream else [answer]


@router.get("/info")
def info(http: Request) -> dict:
    """TGI's description of the served model and its limits (what clients and load generators read first)."""
    state = state_of(http)
    served = state.model_router.models[0]
    runtime = served.current.runtime
    # the model's context, or the server's room per request
    context = served.current.scheduler.request_tokens or runtime.context_length
    return {
        "model_id": served.served_id,
        "model_sha": None,
        "model_dtype": runtime.manifest.runtime_settings().dtype,
        "model_device_type": _device_type(runtime),
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": served.current.scheduler.max_queue,
        "max_best_of": 1,
        "max_stop_sequences": 4,
        "max_input_tokens": context - 1,
        "max_input_length": context - 1,
        "max_total_tokens": context,
        "max_client_batch_size": 1,
        "validation_workers": 1,
        "router": "llmopt",
        "version": _version(),
        "sha": None,
        "docker_label": None,
    }


def _device_type(runtime: object) -> str:
    """Where the model runs, as TGI names it ("cpu", "cuda"): the torch engine's device; the others run on the CPU."""
    device = getattr(runtime, "device", None)
    return str(getattr(device, "type", None) or device or "cpu")


@router.post("/tokenize")
def tokenize(body: TokenizeRequest, http: Request) -> list[dict]:
    """TGI's tokenization: each token's id, text and character span in the input."""
    runtime = state_of(http).model_router.models[0].current.runtime
    encoded = runtime.tokenizer(body.inputs, add_special_tokens=False, return_offsets_mapping=True)
    return [
        {"id": token, "text": body.inputs[start:stop], "start": start, "stop": stop}
        for token, (start, stop) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
    ]


_KINDS = {400: "validation", 413: "validation", 422: "validation", 429: "overloaded", 500: "generation"}


def error_body(status: int, message: str, kind: str) -> dict:
    """TGI's error shape, `{"error": ..., "error_type": ...}`, with TGI's kinds where TGI has one for the status
    (validation, overloaded, generation) and the server's own otherwise (authentication_error, not_found, ...)."""
    return {"error": message, "error_type": _KINDS.get(status, kind)}


async def _answer(body: GenerateRequest, http: Request, stream: bool) -> Any:
    state = state_of(http)
    served = state.model_router.models[0]  # TGI's API names no model: the default one answers
    params = body.streamed(stream).parameters
    budget = min(params.max_new_tokens or TGI_DEFAULT_NEW_TOKENS, state.settings.max_new_tokens)
    if params.truncate is None:
        prompt = await encode_prompt(served.current.runtime, body.inputs, budget)
    else:  # what is cut later may be any length: tokenized whole, off the event loop
        prompt = await asyncio.to_thread(served.current.runtime.encode, body.inputs)
        prompt = prompt[-params.truncate :]  # TGI keeps the last `truncate` tokens of the input
    # streamed tokens and `details` carry each token's logprob; a plain answer only the text
    generation = start_generation(
        http, served, prompt, budget, params, token_logprobs=stream or bool(params.details)
    )
    special = set(served.current.runtime.tokenizer.all_special_ids)
    if stream:
        return sse(generation, _events(generation, params, special), _error_event)
    return await _whole(generation, body, http, special)


def _error_event(exc: RequestError) -> dict:
    return error_body(exc.status, str(exc), exc.kind)


async def _whole(generation: Generation, body: GenerateRequest, http: Request, special: set[int]) -> dict:
    tokens, prefill, finish = [], [], None
    tokenizer = generation.loaded.runtime.tokenizer
    async for event in generation.events(http.is_disconnected):
        if isinstance(event, Piece):
            tokens.append(event)
        elif isinstance(event, PromptScores):
            prefill = [
                {"id": token, "text": tokenizer.decode([token]), "logprob": logprob}
                for token, logprob, _ in event.entries
            ]
        else:
            finish = event
    text = "".join(piece.text for piece in tokens) + finish.stop_text  # TGI keeps the stop sequence
    params = body.parameters
    answer: dict[str, Any] = {"generated_text": (body.inputs + text) if params.return_full_text else text}
    if params.details:
        generated = _with_tail(tokens, finish.stop_text)
        answer["details"] = {
            **_details(finish, params.seed),
            "prefill": prefill,
            "tokens": [_token(piece, special, tokenizer) for piece in generated],
        }
        if params.top_n_tokens:
            answer["details"]["top_tokens"] = [_top(piece, special, tokenizer) for piece in generated]
    return answer


def _with_tail(pieces: list[Piece], stop_text: str) -> list[Piece]:
    """The generated tokens, text released after the last one (and a kept stop sequence) joined to it."""
    tokens = [Piece(p.text, p.token, p.logprob, p.top) for p in pieces if p.token is not None]
    tail = "".join(p.text for p in pieces if p.token is None) + stop_text
    if tokens and tail:
        tokens[-1].text += tail
    return tokens


async def _events(generation: Generation, params: Any, special: set[int]) -> AsyncIterator[dict]:
    # the last token goes with the final event, which carries the whole text
    text: list[str] = []
    pending, count = None, 0
    tokenizer = generation.loaded.runtime.tokenizer
    async for event in generation.events():
        if isinstance(event, Piece):
            text.append(event.text)
            if event.token is None and pending is not None:  # released tail text rides on the last token
                pending.text += event.text
                continue
            if pending is not None:
                yield _stream_event(count, pending, special, tokenizer, params, None)
            pending, count = Piece(event.text, event.token, event.logprob, event.top), count + 1
            continue
        final = pending or Piece("", generation.loaded.runtime.eos_token_id or 0, 0.0)
        final.text += event.stop_text
        done = {"generated_text": "".join(text) + event.stop_text, "details": _details(event, params.seed)}
        yield _stream_event(max(count, 1), final, special, tokenizer, params, done)


def _stream_event(
    index: int, piece: Piece, special: set[int], tokenizer: Any, params: Any, done: dict | None
) -> dict:
    event = {"index": index, "token": _token(piece, special, tokenizer)}
    if params.top_n_tokens:
        event["top_tokens"] = _top(piece, special, tokenizer)
    return {**event, **(done or {"generated_text": None, "details": None})}


def _token(piece: Piece, special: set[int], tokenizer: Any) -> dict:
    """TGI's token: a special token (end of sequence) is marked and shows its own text, as TGI shows it."""
    marked = piece.token in special
    text = tokenizer.decode([piece.token]) if marked else piece.text
    return {"id": piece.token, "text": text, "logprob": piece.logprob, "special": marked}


def _top(piece: Piece, special: set[int], tokenizer: Any) -> list[dict]:
    return [
        {"id": token, "text": tokenizer.decode([token]), "logprob": logprob, "special": token in special}
        for token, logprob in piece.top or []
    ]


def _details(finish: Finish, seed: int | None) -> dict:
    reason = (
        "stop_sequence" if finish.stop_string else {"stop": "eos_token", "length": "length"}[finish.reason]
    )
    return {"finish_reason": reason, "generated_tokens": finish.completion_tokens, "seed": seed}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmopt")
    except PackageNotFoundError:
        return "source"


register_api(
    WireApi(
        "tgi", router, error_body, frozenset({"/", "/generate", "/generate_stream", "/info", "/tokenize"})
    )
)
