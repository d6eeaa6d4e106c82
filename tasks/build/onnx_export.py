"""onnx_genai step: export a float HF folder to ONNX Runtime GenAI with its model builder (int4/int8/fp32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks.config import OnnxGenAIStep
from tasks.errors import ModelSourceError


def build_onnx_genai(source: Path, dest: Path, step: OnnxGenAIStep, cache: Path) -> None:
    """Run ONNX Runtime GenAI's model builder offline on an HF folder; its log is shown only if it fails."""
    options = [f"block_size={step.block_size}", f"is_symmetric={str(step.symmetric).lower()}"]
    if step.accuracy_level:
        options.append(f"accuracy_level={step.accuracy_level}")
    if not step.symmetric:
        # builder 0.18 emits an invalid graph for an asymmetric (uint4) embedding shared with lm_head
        options.append("shared_embeddings=false")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(dest)]
    command += ["-p", step.precision, "-e", "cpu", "-c", str(cache), "--extra_options", *options]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if result.returncode != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ModelSourceError(f"onnx_genai: the model builder failed on {source}: {tail}")
