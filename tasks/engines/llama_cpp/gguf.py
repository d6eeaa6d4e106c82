"""llama_cpp step: a float HF folder → GGUF (llama.cpp's own converter) → a llama.cpp file type (its quantizer).

The converter (`convert_hf_to_gguf.py`, its `conversion` package and `gguf-py`) ships in the llama.cpp tree inside
llama-cpp-python's source package; `make install` builds the wheel from that package once per machine and puts
the converter into `.venv/share/llama.cpp`. Quantization runs in process through `llama_model_quantize`, with an
optional importance matrix measured here on the calibration split (what llama.cpp's `llama-imatrix` tool measures:
the mean squared input activation of every weight column), passed to the quantizer as `llama_model_imatrix_data`.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.errors import BuildError

CONVERTER_DIR = Path(sys.prefix) / "share" / "llama.cpp"  # filled by `make install`
CONVERTER = CONVERTER_DIR / "convert_hf_to_gguf.py"
BLOCK, SCALE_BYTES = 32, 2  # Q4_0, IQ4_NL and Q8_0: blocks of 32 weights, one float16 scale each
PLAN_TYPES = {8: "Q8_0"}  # what the mixed-precision plan keeps at 8 bits

# llmopt's names of llama.cpp file types → llama_ftype names (llama.h)
FILE_TYPES = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}


# Hugging Face Llama-style module names → GGUF tensor names (what the quantizer looks importance data up by)
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def convert_to_gguf(source: Path, out_file: Path) -> str:
    """Convert an HF folder to an F32 GGUF with llama.cpp's converter (in a subprocess; its log is shown only on
    failure). Returns a note when the tokenizer's pre-tokenizer was unknown to llama.cpp."""
    if not CONVERTER.is_file():
        raise BuildError(
            f"llama_cpp: llama.cpp's converter is missing ({CONVERTER}); run `make install` (it unpacks it from "
            "llama-cpp-python's source package)"
        )
    command = [
        sys.executable,
        "-m",
        "tasks.engines.llama_cpp.gguf_convert",
        str(CONVERTER),
        str(source),
        str(out_file),
    ]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py of its own llama.cpp tree
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0 or not out_file.is_file():
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise BuildError(f"llama_cpp: llama.cpp's converter failed on {source}: {tail}")
    if "llmopt: unknown pre-tokenizer" in result.stderr:
        return (
            "the tokenizer's pre-tokenizer is unknown to llama.cpp: the GGUF records 'default' (llmopt always "
            "tokenizes with the Hugging Face tokenizer beside it, so its measurements are unaffected)"
        )
    return ""


def quantize_gguf(
    source: Path,
    dest: Path,
    file_type: str,
    imatrix: dict[str, Any] | None = None,
    threads: int = 0,
    tensor_types: dict[str, str] | None = None,
) -> None:
    """`llama_model_quantize` from an F32/F16 GGUF to `file_type`, with importance data by tensor name and
    `tensor_types` (tensor name → ggml type name such as Q8_0) in place of llama.cpp's own choice for them."""
    from tasks.engines.llama_cpp.runtime import llama_cpp_module

    lib = llama_cpp_module()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, FILE_TYPES[file_type])
    params.nthread = threads
    keep: list[Any] = []  # the arrays the C side reads, alive until the call returns
    if tensor_types:
        overrides = (lib.llama_model_tensor_override * (len(tensor_types) + 1))()  # pattern NULL ends it
        for entry, (name, tensor_type) in zip(overrides, sorted(tensor_types.items()), strict=False):
            keep.append(f"^{re.escape(name)}$".encode())  # llama.cpp matches the pattern as a regex
            entry.pattern, entry.type = keep[-1], getattr(lib, f"GGML_TYPE_{tensor_type}")
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(lib.llama_model_tensor_override))
        keep.append(overrides)
    if imatrix:
        entries = (lib.llama_model_imatrix_data * (len(imatrix) + 1))()
        for entry, (name, values) in zip(entries, sorted(imatrix.items()), strict=False):
            data = (ctypes.c_float * len(values))(*values)
            keep += [name.encode(), data]
            entry.name, entry.data, entry.size = (
                keep[-2],
                ctypes.cast(data, ctypes.POINTER(ctypes.c_float)),
                len(values),
            )
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(lib.llama_model_imatrix_data))
        keep.append(entries)
    status = lib.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if status != 0 or not dest.is_file():
        raise BuildError(f"llama_cpp: llama.cpp could not quantize {source.name} to {file_type}")


def importance_matrix(
    model: Any, windows: list[list[int]], progress: Callable[[str, int, int], None] | None = None
) -> dict[str, list[float]]:
    """Per GGUF weight tensor: the mean over calibration tokens of each input column's squared activation.

    Captured over every linear module that becomes a GGUF matrix plus the lm_head, keyed by module name: for a
    Llama-style model that is the ONNX export's capture for importance-weighted scales with round-to-nearest (same
    modules, statistic and windows: the default `scales: weighted`, 32 windows each), so inside the statistics cache
    the two exports share one calibration pass. (With GPTQ the export's capture holds the Hessians too: no sharing.)"""
    import torch

    from tasks.techniques.gptq_rounding import calibration_inputs

    modules = {
        module_name: module
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (module_name == "lm_head" or gguf_tensor_name(module_name, model) is not None)
    }
    report = (lambda done, total: progress("imatrix", done, total)) if progress else None
    means = calibration_inputs(model, modules, windows, report, hessians=False).importance
    named = {gguf_tensor_name(module_name, model): mean for module_name, mean in means.items()}
    return {name: named[name].tolist() for name in sorted(n for n in named if n is not None)}


def gguf_tensor_name(module_name: str, model: Any) -> str | None:
    """The GGUF tensor a Llama-style HF module becomes (None: not a quantized matrix, or a tied lm_head, which
    reuses the token embedding table)."""
    if module_name == "lm_head":
        return None if model.config.tie_word_embeddings else "output.weight"
    parts = module_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _GGUF_NAMES:
        return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:])]}.weight"
    return None


def gguf_matrices(model: Any) -> list[Any]:
    """The decoder layers' weight matrices as GGUF tensors, for the mixed-precision search (the output table is
    left to llama.cpp's choice for the file type)."""
    import torch

    from tasks.techniques.mixed_precision import Matrix

    matrices = []
    for module_name, module in model.named_modules():
        name = gguf_tensor_name(module_name, model)
        if name and name.startswith("blk.") and isinstance(module, torch.nn.Linear):
            matrices.append(Matrix(name, (module_name,), module.weight.numel()))
    if not matrices:
        raise ValueError(f"mixed_precision: supports Llama-style decoders, not {type(model).__name__}")
    return matrices


def tensor_types(path: Path) -> dict[str, str]:
    """Tensor name → ggml type name (Q4_0, Q8_0 …) of a GGUF file."""
    from gguf import GGUFReader

    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors}


def layer_of(matrix: Any) -> str:
    """The decoder layer a GGUF tensor belongs to (blk.3.ffn_down.weight → blk.3)."""
    return ".".join(matrix.node.split(".")[:2])


def shipped_gguf(source: str) -> Path:
    """The GGUF file the model source ships (the embedded SmolLM2's, or the one .gguf in a local folder)."""
    from tasks.inputs.load import EMBEDDED_SMOLLM2, embedded_gguf_path

    if source == EMBEDDED_SMOLLM2:
        return embedded_gguf_path()
    files = sorted(Path(source).glob("*.gguf")) if Path(source).is_dir() else []
    if len(files) != 1:
        raise ValueError(
            f"type: shipped needs a model source that ships one GGUF file; {source!r} has {len(files)}"
        )
    return files[0]
