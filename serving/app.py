"""HTTP serving of a registered variant: OpenAI-style /v1/completions, /v1/models and /health."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from tasks.config import Config
from tasks.engines import Runtime


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completion request this server honours; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, le=4096)
    model: str | None = None
    temperature: float = Field(0.0, ge=0.0, le=0.0, description="Greedy decoding only, for now.")


def create_app(runtime: Runtime, model_name: str, version: str, max_new_tokens: int) -> FastAPI:
    """The FastAPI application around one loaded runtime."""
    app = FastAPI(title="llmopt server", version="0.1.0")
    served_id = f"{model_name}/{version}"

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": served_id, "variant": runtime.manifest.name}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": served_id, "object": "model", "owned_by": "llmopt"}]}

    @app.post("/v1/completions")
    def complete(request: CompletionRequest) -> dict:
        prompt_ids = runtime.encode(request.prompt)
        (completion,) = runtime.generate([prompt_ids], min(request.max_tokens, max_new_tokens))
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served_id,
            "choices": [
                {
                    "index": 0,
                    "text": runtime.decode(completion),
                    "finish_reason": _finish(completion, request),
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt_ids) + len(completion),
            },
        }

    def _finish(completion: list[int], request: CompletionRequest) -> str:
        return "length" if len(completion) >= min(request.max_tokens, max_new_tokens) else "stop"

    return app


def serve_registered_model(config: Config, root: Path, alias: str, host: str, port: int) -> None:
    """Resolve `models:/<name>@<alias>`, load it through the Runtime and serve it with uvicorn."""
    import uvicorn

    from tasks.decide.registry import resolve_alias
    from tasks.engines import load_runtime
    from tasks.report.tracking import configure_tracking

    configure_tracking(config.tracking, root)
    with tempfile.TemporaryDirectory(prefix="llmopt-serve-") as scratch:
        version, folder = resolve_alias(config.project.name, alias, Path(scratch))
        runtime = load_runtime(folder, config.target.threads)
        app = create_app(runtime, config.project.name, version, config.serve.max_new_tokens)
        uvicorn.run(app, host=host, port=port, log_level="info")
