"""HTTP serving of a registered variant: OpenAI-style /v1/completions, /v1/models and /health.

The served model is swapped whole when the registry alias moves (the deploy stage): a watcher loads the new
version beside the old one, verifies its bytes, warms it up and only then replaces it. A request keeps the model it
started on, so nothing in flight is dropped; a version that fails to load leaves the old one serving and the
failure shows in /health."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from tasks.config import Config
from tasks.engines import Runtime

log = logging.getLogger("llmopt.serve")


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completion request this server honours; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, le=4096)
    model: str | None = None
    temperature: float = Field(0.0, ge=0.0, le=0.0, description="Greedy decoding only, for now.")


@dataclass(eq=False)
class LoadedModel:
    """One loaded version. Its engine runs one generation at a time (neither og.Model nor a torch module is safe
    to drive from several request threads); `keep` holds whatever must live as long as it (its download)."""

    version: str
    runtime: Runtime
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: Any = None

    def complete(self, prompt: str, max_tokens: int) -> tuple[list[int], list[int], str]:
        """(prompt ids, completion ids, completion text), greedy; the tokenizer is not shared across threads
        either (fast tokenizers refuse concurrent use), so it runs under the lock too."""
        with self.lock:
            prompt_ids = self.runtime.encode(prompt)
            (completion,) = self.runtime.generate([prompt_ids], max_tokens)
            return prompt_ids, completion, self.runtime.decode(completion)


class ServedModel:
    """The model the server answers with right now, replaced atomically by `swap`."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._current = loaded
        self.last_error: str | None = None  # why the alias's version is not the one served, if it is not

    @property
    def current(self) -> LoadedModel:
        return self._current

    def swap(self, loaded: LoadedModel) -> None:
        """From now on new requests go to `loaded`; requests already running finish on the old model, which is
        freed (download folder included) when the last of them lets go of it."""
        self._current, self.last_error = loaded, None


def create_app(served: ServedModel | Runtime, model_name: str, version: str, max_new_tokens: int) -> FastAPI:
    """The FastAPI application around the served model (a bare runtime is served as `version`, never swapped)."""
    if not isinstance(served, ServedModel):
        served = ServedModel(LoadedModel(version, served))
    app = FastAPI(title="llmopt server", version="0.1.0")

    @app.get("/health")
    def health() -> dict:
        loaded = served.current
        return {
            "status": "ok",
            "model": f"{model_name}/{loaded.version}",
            "version": loaded.version,
            "variant": loaded.runtime.manifest.name,
            "swap_error": served.last_error,
        }

    @app.get("/v1/models")
    def models() -> dict:
        served_id = f"{model_name}/{served.current.version}"
        return {"object": "list", "data": [{"id": served_id, "object": "model", "owned_by": "llmopt"}]}

    @app.post("/v1/completions")
    def complete(request: CompletionRequest) -> dict:
        loaded = served.current  # this request's model, even if a swap happens meanwhile
        limit = min(request.max_tokens, max_new_tokens)
        prompt_ids, completion, text = loaded.complete(request.prompt, limit)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": f"{model_name}/{loaded.version}",
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "finish_reason": "length" if len(completion) >= limit else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt_ids) + len(completion),
            },
        }

    return app


def load_version(model_name: str, version: str, threads: int) -> LoadedModel:
    """Download a registered version, check its bytes against the hash the registry recorded, load and warm it."""
    from tasks.decide.registry import download_verified
    from tasks.engines import load_runtime

    scratch = tempfile.TemporaryDirectory(prefix=f"llmopt-serve-v{version}-")
    try:
        runtime = load_runtime(download_verified(model_name, version, Path(scratch.name)), threads)
    except BaseException:
        scratch.cleanup()
        raise
    runtime.generate([runtime.encode("warm up")], 1)  # the first call pays for allocation, not a client
    return LoadedModel(version, runtime, keep=scratch)


def watch_alias(
    served: ServedModel, model_name: str, alias: str, threads: int, every_s: float
) -> threading.Thread:
    """A daemon thread that swaps in the version `alias` points to whenever it moves (checked every `every_s`)."""

    def check_once(refused: set[str]) -> None:
        from tasks.decide.registry import current_version
        from tasks.errors import LlmoptError

        version = current_version(model_name, alias)
        if version is None or version == served.current.version:
            served.last_error = None  # the alias is back on what is served (a rollback): nothing is wrong
            return
        if version in refused:
            return
        try:
            loaded = load_version(model_name, version, threads)
        except Exception as exc:  # keep serving the old model and say why in /health
            if isinstance(exc, LlmoptError):
                refused.add(version)  # its bytes or its registration are wrong: retrying cannot help
            served.last_error = f"v{version} failed to load, still serving v{served.current.version}: {exc}"
            log.error(served.last_error)
            return
        previous = served.current.version
        served.swap(loaded)
        log.warning(f"{model_name}@{alias} moved: now serving v{version} (was v{previous})")

    def loop() -> None:
        refused: set[str] = set()
        while True:
            time.sleep(every_s)  # the registry has no notifications: poll at the configured pace
            try:
                check_once(refused)
            except Exception as exc:  # the registry itself unreachable: keep serving, try again next time
                served.last_error = f"cannot read {model_name}@{alias}: {exc}"
                log.error(served.last_error)

    thread = threading.Thread(target=loop, name="llmopt-alias-watch", daemon=True)
    thread.start()
    return thread


def serve_registered_model(config: Config, root: Path, alias: str, host: str, port: int) -> None:
    """Serve `models:/<name>@<alias>` with uvicorn, following the alias when it moves (serve.watch_s)."""
    import uvicorn

    from tasks.decide.registry import current_version
    from tasks.errors import RegistryError
    from tasks.report.tracking import configure_tracking

    configure_tracking(config.tracking, root)
    name = config.project.name
    version = current_version(name, alias)
    if version is None:
        raise RegistryError(f"no model version {name}@{alias} in the registry; run `llmopt run` first")
    served = ServedModel(load_version(name, version, config.target.threads))
    if config.serve.watch_s > 0:
        watch_alias(served, name, alias, config.target.threads, config.serve.watch_s)
    app = create_app(served, name, version, config.serve.max_new_tokens)
    uvicorn.run(app, host=host, port=port, log_level="info")
