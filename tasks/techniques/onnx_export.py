"""onnx_genai step: export a float HF folder to ONNX Runtime GenAI with its model builder (int4/int8/fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tasks.config import OnnxGenAIStep
from tasks.errors import ModelSourceError
from tasks.failpoints import failpoint


def build_onnx_genai(
    source: Path, dest: Path, step: OnnxGenAIStep, cache: Path, target_options: dict | None = None
) -> None:
    """Run ONNX Runtime GenAI's model builder offline on an HF folder; its log is shown only if it fails.
    `target_options`: the builder's structured options (e.g. per-node weight types of a mixed-precision plan)."""
    options = [f"block_size={step.block_size}", f"is_symmetric={str(step.symmetric).lower()}"]
    if step.accuracy_level:
        options.append(f"accuracy_level={step.accuracy_level}")
    if not step.symmetric:
        # builder 0.18 emits an invalid graph for an asymmetric (uint4) embedding shared with lm_head
        options.append("shared_embeddings=false")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(dest)]
    command += ["-p", step.precision, "-e", "cpu", "-c", str(cache)]
    if target_options:
        options_file = cache.parent / "target_options.json"
        options_file.write_text(json.dumps(target_options))
        command += ["--target_options", str(options_file)]
    command += ["--extra_options", *options]
    # GIT_DIR: the builder stamps `git rev-parse HEAD` of the folder above its install into the graph's
    # producer_version, which is this project when .venv lives in it: without this, every commit changed the bytes
    env = {**os.environ, "TQDM_DISABLE": "1", "GIT_DIR": os.devnull}
    failpoint("onnx_export")  # tests: stop with the staging folder made, before the builder writes into it
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ModelSourceError(f"onnx_genai: the model builder failed on {source}: {tail}")


def weight_bits(folder: Path) -> dict[str, int]:
    """The bits of every MatMulNBits node in an exported model.onnx, by node name without its _Q4/_Q8 suffix, and
    of a quantized embedding (GatherBlockQuantized)."""
    import onnx

    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    bits = {
        node.name.rsplit("_Q", 1)[0]: next(a.i for a in node.attribute if a.name == "bits")
        for node in graph.node
        if node.op_type == "MatMulNBits"
    }
    for node in graph.node:  # a quantized embedding table (int4 only; shared with the lm_head when tied)
        if node.op_type == "GatherBlockQuantized":
            bits[node.name] = next((a.i for a in node.attribute if a.name == "bits"), 4)
    return bits
