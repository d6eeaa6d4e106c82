"""Engines: the Runtime contract (`contract.py`) and one package per engine, each registered by name
(`registry.py`): `pytorch/`, `onnx/`, `llama_cpp/`, each with its runtime in `runtime.py` and, where the engine has
one, the export technique that builds its variants in `export.py` (the technique catalog loads those).

Evaluation, benchmark and serving open every variant with `load_runtime`; nothing outside this package needs to
know which engine runs a variant. Importing the package registers the built-in engines; plug-in engines
(tasks/plugins.py) register when a variant is first opened.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tasks.config import TargetConfig
from tasks.engines import speculative
from tasks.engines.contract import Runtime
from tasks.engines.manifest import same_tokenizer, verify_variant
from tasks.engines.registry import ENGINES
from tasks.errors import ArtifactError, TargetError
from tasks.plugins import load_plugins

# The built-in engines, one package each under tasks/engines/: adding one is its folder and a name here.
BUILT_IN = ("pytorch", "onnx", "llama_cpp")
for _engine in BUILT_IN:
    importlib.import_module(f"tasks.engines.{_engine}.runtime")  # registers the engine

__all__ = ["ENGINES", "Runtime", "load_runtime"]


def load_runtime(folder: Path, target: TargetConfig) -> Runtime:
    """Open the variant in `folder` with the engine its manifest names on the `target` (params.yaml `target`: its
    device, its CPU threads unless the recipe sets them, and with `tensor_parallel` > 1 the torch engine split over
    that many ranks, which llmopt starts: tasks/engines/pytorch/tensor_parallel.py), once its bytes are verified
    against the manifest's content hash (a damaged file is an ArtifactError)."""
    manifest = verify_variant(folder)
    load_plugins()
    if manifest.engine not in ENGINES:
        raise ArtifactError(f"{folder}: engine {manifest.engine!r} unknown; known: {', '.join(ENGINES)}")
    engine = ENGINES[manifest.engine]
    if target.device.partition(":")[0] not in engine.DEVICES:
        raise TargetError(
            f"{folder}: the {manifest.engine} engine runs on {', '.join(engine.DEVICES)}, not {target.device}"
        )
    threads = manifest.runtime_settings().threads or target.threads
    target = target.model_copy(update={"threads": threads})
    if target.tensor_parallel > 1:
        if engine is not ENGINES["torch"]:
            raise TargetError(f"{folder}: tensor parallelism is the torch engine's, not {manifest.engine}'s")
        if manifest.runtime_settings().speculative is not None:
            raise TargetError(f"{folder}: speculative decoding runs on one device, not split over ranks")
        from tasks.engines.pytorch.tensor_parallel import TensorParallelRuntime

        return TensorParallelRuntime(folder, manifest, target)
    runtime = engine(folder, manifest, target)
    attach_speculation(runtime, folder, target)
    return runtime


def attach_speculation(runtime: Runtime, folder: Path, target: TargetConfig) -> None:
    """Give `runtime` its variant's speculation (from its manifest's runtime settings), loading a draft variant
    from the folder's `draft/` (checked like any variant, and required to share the tokenizer)."""
    settings = runtime.manifest.runtime_settings().speculative
    if settings is None:
        return
    draft = None
    if settings.method == "draft":
        where = Path(folder) / speculative.DRAFT_FOLDER
        if not where.is_dir():
            raise ArtifactError(
                f"{folder}: speculative method draft, but no {speculative.DRAFT_FOLDER}/ folder inside"
            )
        if not same_tokenizer(Path(folder), where):
            raise ArtifactError(
                f"{where}: the draft's tokenizer differs from the variant's; it cannot propose"
            )
        draft = load_runtime(where, target.model_copy(update={"tensor_parallel": 1}))
    runtime.speculation = speculative.Speculation(settings, draft)
