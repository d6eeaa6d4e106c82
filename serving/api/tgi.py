"""TGI's wire API: `/generate`, `/generate_stream` and `/` (where TGI's clients post to a base URL), answered
with TGI's tokens and details, and TGI's error shape inside a stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from serving.api.common import require_api_key, sse, start_generation, state_of
from serving.api.tgi_protocol import GenerateRequest
from serving.generation import Finish, Generation, Piece
from serving.text import RequestError

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


async def _answer(body: GenerateRequest, http: Request, stream: bool) -> Any:
    state = state_of(http)
    served = state.model_router.models[0]  # TGI's API names no model: the default one answers
    params = body.parameters
    budget = min(params.max_new_tokens or TGI_DEFAULT_NEW_TOKENS, state.settings.max_new_tokens)
    prompt = served.current.runtime.encode(body.inputs)
    generation = start_generation(http, served, prompt, budget, params)
    if stream:
        return sse(generation, _events(generation, params.seed), _error_event)
    return await _whole(generation, body, http)


def _error_event(exc: RequestError) -> dict:
    return {"error": str(exc), "error_type": exc.kind}


async def _whole(generation: Generation, body: GenerateRequest, http: Request) -> dict:
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
            **_details(finish, body.parameters.seed),
            "prefill": [],
            "tokens": [_token(piece) for piece in tokens if piece.token is not None],
        }
    return answer


async def _events(generation: Generation, seed: int | None) -> AsyncIterator[dict]:
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
                    "token": _token(pending),
                    "generated_text": None,
                    "details": None,
                }
            pending = event
            continue
        final = pending or Piece("", generation.loaded.runtime.eos_token_id or 0, 0.0)
        yield {
            "index": len(text),
            "token": _token(final),
            "generated_text": "".join(text),
            "details": _details(event, seed),
        }


def _token(piece: Piece) -> dict:
    return {"id": piece.token, "text": piece.text, "logprob": piece.logprob, "special": False}


def _details(finish: Finish, seed: int | None) -> dict:
    reason = (
        "stop_sequence" if finish.stop_string else {"stop": "eos_token", "length": "length"}[finish.reason]
    )
    return {"finish_reason": reason, "generated_tokens": finish.completion_tokens, "seed": seed}
