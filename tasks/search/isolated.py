"""A variant's runtime in a process of its own, for the search's races: engines sharing one process slow each other
down. Measured on SmolLM2-135M (2 cores): llama.cpp's Q4_0 decoded 84-86 tok/s alone and 32-34 tok/s in a process
where the torch baseline had run once (an extra busy thread beside llama.cpp's two; no OpenMP setting cured it),
which would have put every llama.cpp candidate ×2.5 behind an ONNX leader. The pipeline's benchmark runs each
variant in a fresh process for the same reason; the search keeps one long-lived process per loaded variant instead,
so its many short timings do not pay a load each.

The child loads the runtime and answers calls over a pipe, one at a time; while one variant decodes, the others'
processes wait on their pipes (asleep), so a speed pair's two runs each have the cores to themselves. Timings are
taken in the child. A child's error comes back as the parent's exception (the engine's own message)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from tasks.config import TargetConfig
from tasks.errors import EngineError


class IsolatedRuntime:
    """The calls the search makes of a runtime (`encode`, `score`, `position_logits`, `generate`, `timed_decode`),
    answered by a child process that holds the variant at `folder`."""

    def __init__(self, folder: Path, target: TargetConfig, timeout_s: float = 600.0) -> None:
        from tasks.engines.manifest import read_manifest
        from tasks.measure.processes import fresh_process_context

        # nothing of this process's threads: a spawned interpreter, or for torch one forked from a server that ran
        # nothing but its imports
        context = fresh_process_context(read_manifest(folder).engine)
        self._conn, child = context.Pipe()
        self._timeout_s = timeout_s
        self._process = context.Process(
            target=_serve,
            args=(child, str(folder), target.model_dump(), dict(os.environ)),
            daemon=True,
            name=f"llmopt-{folder.name}",
        )
        self._process.start()
        child.close()
        try:
            self._call("ready")
        except BaseException:
            self.close()  # a child that could not load ends with nothing left open
            raise

    def encode(self, text: str) -> list[int]:
        return self._call("encode", text)

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        return self._call("score", sequences)

    def position_logits(self, ids: list[int]) -> Any:
        return self._call("position_logits", ids)

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True
    ) -> list[list[int]]:
        return self._call("generate", prompts, max_new_tokens, stop_at_eos)

    def timed_decode(self, prompt: list[int], new_tokens: int) -> float:
        """Decode tok/s of one greedy call, timed in the child (see `proxies.timed_decode`)."""
        return self._call("timed_decode", prompt, new_tokens)

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):  # already gone
                self._conn.send(("close", ()))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        if not self._conn.poll(self._timeout_s):
            self.close()
            raise EngineError(f"{self._process.name}: no answer to {method} in {self._timeout_s:g} s")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"{self._process.name}: the process ended during {method}") from None
        if not ok:
            raise EngineError(f"{self._process.name}: {value}")
        return value


def _serve(conn: Any, folder: str, target: dict[str, Any], environment: dict[str, str]) -> None:
    """The child: load the runtime, then answer calls until told to close (or the parent goes)."""
    from tasks.engines import load_runtime
    from tasks.measure.processes import take_parents_environment
    from tasks.quiet import quiet_libraries
    from tasks.search.proxies import timed_decode

    take_parents_environment(environment, to_log_file=False)
    quiet_libraries()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes this process
    try:
        runtime = load_runtime(Path(folder), TargetConfig(**target))
    except Exception as exc:  # the parent raises it
        conn.send((False, f"cannot load: {exc}"))
        return
    calls = {
        "ready": lambda: True,
        "encode": runtime.encode,
        "score": runtime.score,
        "position_logits": lambda ids: runtime.position_logits(ids),
        "generate": runtime.generate,
        "timed_decode": lambda prompt, tokens: timed_decode(runtime, prompt, tokens),
    }
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "close":
            getattr(runtime, "close", lambda: None)()
            return
        try:
            conn.send((True, calls[method](*args)))
        except Exception as exc:  # one call's failure is its answer; the child goes on
            conn.send((False, f"{type(exc).__name__}: {exc}"))
