"""What a registered model needs to load and serve: pinned pip requirements, from the serving set and what its
recorded steps name (the techniques' `packages`)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from tasks.engines.manifest import VariantManifest

# What every registered model needs to load and serve through its Runtime, pinned to this environment's
# versions: MLflow's scoring server, the tokenizer and both engines (so versions share one serving environment).
SERVING_PACKAGES = (
    "mlflow",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pydantic",
    "pyyaml",
    "onnxruntime",
    "onnxruntime-genai",
)


def model_requirements(manifest: VariantManifest, folder: Path | None = None) -> list[str]:
    """Pinned pip requirements of a registered variant: the serving packages plus its weights format's backend
    (and its speculative draft's, from `folder`/draft, which may run in another engine)."""
    from tasks.engines.manifest import read_manifest
    from tasks.engines.speculative import DRAFT_FOLDER
    from tasks.techniques import catalog, registry

    catalog.load()  # the techniques that read the recorded steps back (loaded once per process)
    packages = list(SERVING_PACKAGES)
    steps = list(manifest.recipe.get("steps", []))
    if folder is not None and (folder / DRAFT_FOLDER).is_dir():
        steps += read_manifest(folder / DRAFT_FOLDER).recipe.get("steps", [])
    for step in steps:
        for name, settings in step.items():
            read = registry.recorded_settings(name, settings)
            extra = read[0].packages(read[1]) if read else []
            packages += [package for package in extra if package not in packages]
    if manifest.runtime_settings().wrapper == "deepspeed":
        packages.append("deepspeed")
    # a local label such as +cpu is dropped: `==2.13.0` accepts the CPU wheel here and the PyPI release elsewhere
    return [f"{package}=={metadata.version(package).split('+')[0]}" for package in packages]
