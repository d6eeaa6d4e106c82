"""The models a server answers with: loaded from the registry, verified, each with its own scheduler, swapped
whole when its registry alias moves, routed by the request's `model` field.

A swap loads the new version beside the old one, verifies its bytes, warms it up and only then replaces it; the
old version's scheduler finishes what it holds (nothing in flight is dropped) and is then freed. A version that
fails to load leaves the old one serving and the failure shows in /health."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.scheduler import DEFAULT_PREFIX_CACHE_TOKENS, DEFAULT_STEP_TOKENS, Scheduler
from serving.text import RequestError
from tasks.config import ServeConfig, TargetConfig
from tasks.engines import Runtime
from tasks.errors import ArtifactError

log = logging.getLogger("llmopt.serve")


@dataclass(frozen=True)
class Limits:
    """The per-model scheduler settings from `serve`."""

    max_batch: int
    max_queue: int
    prefill_chunk: int = 0
    prefix_reuse: bool = True
    step_tokens: int = DEFAULT_STEP_TOKENS
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS
    sequence_tokens: int | None = None

    @classmethod
    def of(cls, settings: ServeConfig) -> Limits:
        return cls(
            settings.max_batch,
            settings.max_queue,
            settings.prefill_chunk,
            settings.prefix_reuse,
            settings.step_tokens,
            settings.prefix_cache_tokens,
            settings.sequence_tokens,
        )

    def scheduler(self, runtime: Runtime, metrics: Any = None, own_thread: bool = True) -> Scheduler:
        """A scheduler for `runtime` with these settings (its worker started on a thread of its own, or with
        `own_thread` off run by the caller: `Scheduler.run`)."""
        return Scheduler(
            runtime,
            self.max_batch,
            self.max_queue,
            metrics,
            self.prefill_chunk,
            self.prefix_reuse,
            self.step_tokens,
            self.prefix_cache_tokens,
            own_thread,
            self.sequence_tokens,
        )


@dataclass(eq=False)
class LoadedModel:
    """One loaded version and the scheduler that owns its engine; `keep` holds what must live as long as it
    (its download folder)."""

    version: str
    runtime: Runtime
    scheduler: Scheduler
    keep: Any = None

    def retire(self) -> None:
        """After a swap: finish the requests it holds, then let go of the engine (in the background)."""
        held = [self.scheduler]  # handed over, so that nothing of the thread's own keeps the engine alive
        threading.Thread(target=_retire, args=(held,), name="llmopt-retire", daemon=True).start()


def _retire(held: list[Scheduler]) -> None:
    """Close a swapped-out version's scheduler, then collect it: what the server loaded at start is frozen out of
    the collector's way (`gc.freeze` in serving/app.py), and frozen objects in reference cycles are never freed, so
    the first version's engine would stay in memory for the server's life. One full collection per swap."""
    import gc

    scheduler = held.pop()
    scheduler.close()
    del scheduler
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
        gc.freeze()


class ServedModel:
    """A registered model as clients address it (`name@alias`), answered by whichever version is loaded now."""

    def __init__(self, registered: str, alias: str | None, loaded: LoadedModel) -> None:
        self.registered, self.alias = registered, alias
        self._current = loaded
        self.last_error: str | None = None  # why the alias's version is not the one served, if it is not

    @property
    def name(self) -> str:
        """The id /v1/models lists: `name@alias`, or `name/version` for a pinned version."""
        return (
            f"{self.registered}@{self.alias}" if self.alias else f"{self.registered}/{self._current.version}"
        )

    @property
    def current(self) -> LoadedModel:
        return self._current

    @property
    def served_id(self) -> str:
        """What answers carry in their `model` field: the exact version that produced them."""
        return f"{self.registered}/{self._current.version}"

    def answers_to(self, requested: str) -> bool:
        return requested in {self.name, self.served_id, self.alias}

    def swap(self, loaded: LoadedModel) -> None:
        """From now on new requests go to `loaded`; the old version finishes its requests, then is freed."""
        previous, self._current, self.last_error = self._current, loaded, None
        previous.retire()


# What clients send when they do not choose (huggingface_hub's InferenceClient with a base URL sends "dummy", as
# TGI, which serves one model, ignores the field): the default model answers them.
PLACEHOLDER_NAMES = frozenset({"dummy", "tgi"})


class ModelRouter:
    """The served models by the names clients use; the first one answers requests that name none."""

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        self.models = models

    def route(self, requested: str | None) -> ServedModel:
        """The model a request names (None: the default one); unknown names are a 404 listing the served ones."""
        if requested is None or requested in PLACEHOLDER_NAMES:
            return self.models[0]
        for model in self.models:
            if model.answers_to(requested):
                return model
        names = ", ".join(model.name for model in self.models)
        raise RequestError(404, f"model {requested!r} is not served here; served: {names}", "model_not_found")


def load_version(
    model_name: str, version: str, target: TargetConfig, limits: Limits, metrics: Any
) -> LoadedModel:
    """Download a registered version, check its bytes against the hash the registry recorded, load and warm it."""
    from tasks.decide.model_registry import download_verified
    from tasks.engines import load_runtime

    scratch = tempfile.TemporaryDirectory(prefix=f"llmopt-serve-v{version}-")
    try:
        folder = download_verified(model_name, version, Path(scratch.name))
        try:
            runtime = load_runtime(folder, target)
        except ArtifactError as exc:  # bytes as registered, yet the engine refuses them: name the version
            said = str(exc).replace(f"{folder}/", "").replace(str(folder), "").lstrip(": ")
            raise ArtifactError(f"{model_name} v{version}: {said}") from exc
    except BaseException:
        scratch.cleanup()
        raise
    warm_up(runtime)
    scheduler = limits.scheduler(runtime, metrics)
    return LoadedModel(version, runtime, scheduler, keep=scratch)


def warm_up(runtime: Runtime) -> None:
    """One short generation, so that the first client does not pay for the engine's allocations; on a thread that
    ends with it. PyTorch's OpenMP runtime keeps a team of threads per thread that computes for as long as that
    thread lives, and with two teams every step ran ~1.6x as long on 2 cores: the scheduler's worker must be the
    only living thread that has computed."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmopt-warm-up") as pool:
        pool.submit(runtime.generate, [runtime.encode("warm up")], 1).result()


def watch_alias(
    served: ServedModel, target: TargetConfig, every_s: float, limits: Limits, metrics: Any
) -> threading.Thread:
    """A daemon thread that swaps in the version `served.alias` points to whenever it moves (every `every_s`)."""

    def check_once(refused: set[str]) -> None:
        from tasks.decide.model_registry import current_version
        from tasks.errors import LlmoptError

        version = current_version(served.registered, served.alias)
        if version is None or version == served.current.version:
            served.last_error = None  # the alias is back on what is served (a rollback): nothing is wrong
            return
        if version in refused:
            return
        try:
            loaded = load_version(served.registered, version, target, limits, metrics)
        except Exception as exc:  # keep serving the old model and say why in /health
            if isinstance(exc, LlmoptError):
                refused.add(version)  # its bytes or its registration are wrong: retrying cannot help
            served.last_error = f"v{version} failed to load, still serving v{served.current.version}: {exc}"
            log.error(served.last_error)
            return
        previous = served.current.version
        served.swap(loaded)
        log.warning(f"{served.name} moved: now serving v{version} (was v{previous})")

    def loop() -> None:
        refused: set[str] = set()
        while True:
            time.sleep(every_s)  # the registry has no notifications: poll at the configured pace
            try:
                check_once(refused)
            except Exception as exc:  # the registry itself unreachable: keep serving, try again next time
                served.last_error = f"cannot read {served.name}: {exc}"
                log.error(served.last_error)

    thread = threading.Thread(target=loop, name="llmopt-alias-watch", daemon=True)
    thread.start()
    return thread


def parse_model_ref(ref: str, project_model: str) -> tuple[str, str | None, str | None]:
    """(registered name, alias, version) of a `serve.models` entry: `alias`, `name@alias` or `name/version`."""
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return name, alias, None
    if "/" in ref:
        name, version = ref.rsplit("/", 1)
        return name, None, version
    return project_model, ref, None
