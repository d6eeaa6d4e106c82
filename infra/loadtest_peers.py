"""llmopt's server against llama.cpp's own, in one command (`make loadtest-peers`): start `llmopt serve` (the
production version) and one llama-server per GGUF variant the pipeline built (the same files, llama.cpp's own HTTP
server built by infra/llama-server.sh, as many slots and threads as llmopt's server: `serve.max_batch`,
`serve.sequence_tokens` or 2 048 cells a slot, `target.threads`), wait until every one answers, run
`llmopt loadtest --peer ...` against them (fresh servers, the same requests, the servers interleaved, ratios to
llmopt: docs/serving.md), and stop every server it started, whatever happens.

    python infra/loadtest_peers.py LLAMA_SERVER [--params params.yaml] [--mixes load,fixed] [--vllm PYTHON]
        [loadtest options, e.g. --repeats 1]

The load test runs with `--concurrency 1,16 --ignore-eos --repeats 3` and what is given after them (the last
value of an option counts), once per mix, on servers started afresh for each: `load` (params.yaml's `loadtest:`
request set) and `fixed` (96-word prompts, ~128 tokens, from anywhere in a passage, so no shared starts; 64-token
answers). `--vllm PYTHON`: vLLM's CPU build (its own virtual environment, docs/serving.md) serves the base model in
bfloat16 as one more peer. Servers' output goes to <workdir>/peers/<name>.log. A server already answering on
`serve.port` is refused (its caches are warm).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flows.services import answers  # noqa: E402
from tasks.config_serving import LLAMA_STREAM_TOKENS  # noqa: E402
from tasks.errors import LlmoptError  # noqa: E402
from tasks.params_file import load_config  # noqa: E402

DEFAULT_LOADTEST = ["--concurrency", "1,16", "--ignore-eos", "--repeats", "3"]
MIXES = {  # the two: the load test's own request set, and fixed lengths without shared prefixes
    "load": [],
    "fixed": ["--prompt-words", "96", "--max-tokens", "64", "--prompt-start", "anywhere"],
}
# vLLM's CPU build offline, quiet, with 2 GiB of KV cache (docs/serving.md)
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}
FIRST_PEER_PORT = 8081
READY_TIMEOUT_S = 300  # llmopt's server downloads and verifies its version, then warms it up


@dataclass(frozen=True)
class Peer:
    label: str
    command: list[str]
    url: str
    env: dict[str, str] | None = None  # added to this process's environment


def vllm_peer(python: str, base: Path, port: int) -> Peer:
    """vLLM's OpenAI server (its CPU build, run by `python` of its own environment) on the base model in bfloat16."""
    module = "vllm.entrypoints.openai.api_server"
    command = [python, "-m", module, "--model", str(base), "--dtype", "bfloat16", "--max-model-len", "2048"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    return Peer("vllm", command, f"http://127.0.0.1:{port}", VLLM_ENV)


def gguf_peers(
    variants: Path, server: str, slots: int, slot_tokens: int, threads: int, port: int
) -> list[Peer]:
    """One llama-server per GGUF variant in `variants` (its folder's name in the label), on ports from `port`."""
    peers = []
    for index, gguf in enumerate(sorted(variants.glob("*/model.gguf"))):
        name, at = gguf.parent.name, port + index
        command = [
            server,
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * slot_tokens),
        ]
        command += ["--host", "127.0.0.1", "--port", str(at)]
        peers.append(Peer(f"llama-server:{name}", command, f"http://127.0.0.1:{at}"))
    return peers


def llmopt() -> str:
    """This interpreter's `llmopt` (the project's virtual environment), else the one on PATH."""
    beside = Path(sys.executable).parent / "llmopt"
    return str(beside) if beside.is_file() else "llmopt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server", help="llama-server's path (infra/llama-server.sh prints it)")
    parser.add_argument("--params", "-p", default="params.yaml")
    parser.add_argument("--mixes", default="load", help="comma-separated, of: " + ", ".join(MIXES))
    parser.add_argument("--vllm", metavar="PYTHON", help="vLLM's CPU build's interpreter: one more peer")
    known, rest = parser.parse_known_args()
    mixes = [mix for mix in known.mixes.split(",") if mix]
    try:
        config = load_config(Path(known.params))
        if not mixes or set(mixes) - set(MIXES):
            raise LlmoptError(f"--mixes: comma-separated, of {', '.join(MIXES)}; got {known.mixes!r}")
    except LlmoptError as exc:
        print(exc)
        return 2
    serve = config.serve
    url = f"http://{serve.host}:{serve.port}"
    if answers(f"{url}/health"):
        print(f"a server already answers at {url}: stop it first (the comparison needs fresh servers)")
        return 1
    workdir = Path(known.params).resolve().parent / config.project.workdir
    slots, slot_tokens = serve.max_batch, serve.sequence_tokens or LLAMA_STREAM_TOKENS
    peers = gguf_peers(
        workdir / "variants", known.llama_server, slots, slot_tokens, config.target.threads, FIRST_PEER_PORT
    )
    if not peers:
        print(f"{workdir / 'variants'}: no GGUF variant to serve with llama-server; run `make run` first")
        return 1
    if known.vllm:
        peers.append(vllm_peer(known.vllm, workdir / "base", FIRST_PEER_PORT + len(peers)))
    servers = [Peer("llmopt", [llmopt(), "serve", "-p", known.params], url), *peers]
    flags = [arg for peer in peers for arg in ("--peer", f"{peer.url}={peer.label}")]
    loadtest = [llmopt(), "loadtest", "-p", known.params, *DEFAULT_LOADTEST, *rest, *flags]
    codes = [_against(servers, [*loadtest, *MIXES[mix]], workdir / "peers" / mix) for mix in mixes]
    return max(codes)


def _against(servers: list[Peer], loadtest: list[str], logs: Path) -> int:
    """Start `servers` afresh (their output in `logs`), wait until each answers, run `loadtest`, stop them all."""
    logs.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        try:
            for server in servers:
                log = files.enter_context((logs / f"{server.label.replace(':', '-')}.log").open("w"))
                env = {**os.environ, **server.env} if server.env else None
                started.append(  # a group of its own: a server's own children (vLLM's engine) stop with it
                    subprocess.Popen(
                        server.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
            deadline = time.monotonic() + READY_TIMEOUT_S
            for server in servers:
                while not answers(f"{server.url}/health"):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                        print(f"{server.label} did not come up at {server.url}: see {logs}")
                        return 1
                    time.sleep(1)
            print("$ " + " ".join(loadtest), flush=True)
            return subprocess.run(loadtest, check=False).returncode
        finally:  # every server started and its children, whatever happened (Ctrl-C included)
            _stop(started)


def _stop(processes: list[subprocess.Popen]) -> None:
    """Each process's group terminated, then killed where still there after 30 s; returns once all are gone."""
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal_number)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        if all(process.poll() is not None for process in processes):
            return


if __name__ == "__main__":
    sys.exit(main())
