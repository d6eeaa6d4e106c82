"""`make loadtest-peers` (infra/loadtest_peers.py): which llama-servers it starts beside llmopt's, with llmopt's
server's slots and threads, and the clear refusals before it starts anything."""

from __future__ import annotations

import importlib.util
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[2] / "infra" / "loadtest_peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("loadtest_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["loadtest_peers"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["loadtest_peers"]


def test_every_gguf_variant_gets_a_llama_server_with_llmopts_slots_and_threads(peers, tmp_path):
    for name in ("llama_q4_0_mixed", "gguf_shipped"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "onnx_int8").mkdir()  # not a GGUF variant: no peer
    found = peers.gguf_peers(tmp_path, "/bin/llama-server", slots=16, slot_tokens=2048, threads=2, port=8081)
    assert [peer.label for peer in found] == ["llama-server:gguf_shipped", "llama-server:llama_q4_0_mixed"]
    assert [peer.url for peer in found] == ["http://127.0.0.1:8081", "http://127.0.0.1:8082"]
    command = found[1].command
    assert command[:3] == ["/bin/llama-server", "-m", str(tmp_path / "llama_q4_0_mixed" / "model.gguf")]
    assert command[command.index("-np") + 1] == "16" and command[command.index("-c") + 1] == "32768"
    assert command[command.index("-t") + 1] == "2"


def _params(tmp_path: Path, port: int) -> Path:
    """The project's params.yaml with the server on `port` (and the workdir in `tmp_path`, empty)."""
    raw = yaml.safe_load((SCRIPT.parents[1] / "params.yaml").read_text())
    raw["serve"]["port"] = port
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_it_refuses_before_starting_anything(peers, tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(peers.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(
        "sys.argv", ["loadtest_peers.py", "/bin/llama-server", "-p", str(tmp_path / "none.yaml")]
    )
    assert peers.main() == 2 and "file not found" in capsys.readouterr().out

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    running = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=running.serve_forever, daemon=True).start()
    try:
        params = _params(tmp_path, running.server_port)
        monkeypatch.setattr("sys.argv", ["loadtest_peers.py", "/bin/llama-server", "-p", str(params)])
        assert peers.main() == 1 and "already answers" in capsys.readouterr().out
    finally:
        running.shutdown()
    params = _params(tmp_path, running.server_port)  # nobody answers there now
    assert peers.main() == 1 and "no GGUF variant" in capsys.readouterr().out
    assert started == []


def test_each_mix_runs_on_servers_started_afresh_with_vllm_as_one_more_peer(peers, tmp_path, monkeypatch):
    """`--mixes load,fixed --vllm PYTHON`: the servers (llmopt, a llama-server per GGUF, vLLM on the base model with
    its offline environment) started for each mix, the fixed mix's lengths passed to the load test; a mix that
    does not exist is refused before anything starts."""
    params = _params(tmp_path, 18_765)  # nobody answers there
    gguf = tmp_path / ".llmopt" / "variants" / "llama_q4_0_mixed" / "model.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    runs = []
    monkeypatch.setattr(
        peers, "_against", lambda servers, loadtest, logs: runs.append((servers, loadtest, logs)) or 0
    )
    argv = ["loadtest_peers.py", "/bin/llama-server", "-p", str(params), "--mixes", "load,fixed"]
    monkeypatch.setattr("sys.argv", [*argv, "--vllm", "/venv/bin/python", "--repeats", "1"])
    assert peers.main() == 0
    assert [logs.name for _, _, logs in runs] == ["load", "fixed"]
    servers, loadtest, _ = runs[1]
    assert [server.label for server in servers] == ["llmopt", "llama-server:llama_q4_0_mixed", "vllm"]
    vllm = servers[2]
    assert vllm.command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm.command[vllm.command.index("--model") + 1] == str(tmp_path / ".llmopt" / "base")
    assert vllm.env["HF_HUB_OFFLINE"] == "1" and vllm.url == "http://127.0.0.1:8082"
    assert "--prompt-words" not in runs[0][1] and loadtest[-6:] == peers.MIXES["fixed"]
    assert (
        loadtest[loadtest.index("--repeats", loadtest.index("--repeats") + 1) + 1] == "1"
    )  # the last one counts
    assert "http://127.0.0.1:8082=vllm" in loadtest
    runs.clear()
    monkeypatch.setattr("sys.argv", [*argv[:-1], "load,chat"])
    assert peers.main() == 2 and runs == []
