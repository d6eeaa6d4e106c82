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
