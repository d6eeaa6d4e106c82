"""llmopt's server against llama.cpp's own, in one command (`make loadtest-peers`): start `llmopt serve` (the
production version) and one llama-server per GGUF variant the pipeline built (the same files, llama.cpp's own HTTP
server built by infra/llama-server.sh, as many slots and threads as llmopt's server: `serve.max_batch`,
`serve.sequence_tokens` or 2 048 cells a slot, `target.threads`), wait until every one answers, run
`llmopt loadtest --peer ...` against them (fresh servers, the same requests, the servers interleaved, ratios to
llmopt: docs/serving.md), and stop every server it started, whatever happens.

    python infra/loadtest_peers.py LLAMA_SERVER [--params params.yaml] [loadtest options, e.g. --repeats 1]

The load test runs with `--concurrency 1,16 --ignore-eos --repeats 3` and what is given after them (the last
value of an option counts). Servers' output goes to
<workdir>/peers/<name>.log. A server already answering on `serve.port` is refused (its caches are warm).
"""

from __future__ import annotations

import argparse
import contextlib
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
FIRST_PEER_PORT = 8081
READY_TIMEOUT_S = 300  # llmopt's server downloads and verifies its version, then warms it up


@dataclass(frozen=True)
class Peer:
    label: str
    command: list[str]
    url: str


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
    known, rest = parser.parse_known_args()
    try:
        config = load_config(Path(known.params))
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
    servers = [("llmopt", [llmopt(), "serve", "-p", known.params], url)]
    servers += [(peer.label, peer.command, peer.url) for peer in peers]
    logs = workdir / "peers"
    logs.mkdir(parents=True, exist_ok=True)
    flags = [arg for peer in peers for arg in ("--peer", f"{peer.url}={peer.label}")]
    loadtest = [llmopt(), "loadtest", "-p", known.params, *DEFAULT_LOADTEST, *rest, *flags]
    started: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        try:
            for label, command, _ in servers:
                log = files.enter_context((logs / f"{label.replace(':', '-')}.log").open("w"))
                started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + READY_TIMEOUT_S
            for label, _, at in servers:
                while not answers(f"{at}/health"):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                        print(f"{label} did not come up at {at}: see {logs}")
                        return 1
                    time.sleep(1)
            print("$ " + " ".join(loadtest), flush=True)
            return subprocess.run(loadtest, check=False).returncode
        finally:  # every server started, whatever happened (Ctrl-C included)
            for process in started:
                process.terminate()
            for process in started:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    sys.exit(main())
