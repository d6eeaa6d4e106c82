"""`quanto`: optimum-quanto's state dict (`model.safetensors`) plus `quantization_map.json`, reloaded into a float
skeleton with `requantize`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.weights.registry import WeightsFormat, register
from tasks.weights.torch_dynamic import float_skeleton, save_config

if TYPE_CHECKING:
    from tasks.config import RuntimeSettings, TargetConfig

QUANTO = "quanto"
QUANTO_MAP_FILE = "quantization_map.json"


@register
class Quanto(WeightsFormat):
    name = QUANTO
    inference_mode = False

    def save(self, model: Any, dest: Path, dtype: str, record: dict[str, Any] | None) -> None:
        from optimum.quanto import quantization_map
        from safetensors.torch import save_file

        save_config(model, dest)
        state = model.state_dict()
        head, embeddings = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        if head is not None and embeddings is not None and head.data_ptr() == embeddings.data_ptr():
            # tied (left float): safetensors refuses shared tensors; re-tied when loaded
            del state["lm_head.weight"]
        save_file(state, dest / "model.safetensors")
        (dest / QUANTO_MAP_FILE).write_text(json.dumps(quantization_map(model), indent=1, sort_keys=True))

    def load(self, folder: Path, dtype: str, settings: RuntimeSettings, target: TargetConfig) -> Any:
        import torch
        from optimum.quanto import requantize
        from safetensors.torch import load_file

        skeleton = float_skeleton(folder)
        quantization = json.loads((folder / QUANTO_MAP_FILE).read_text())
        state = load_file(folder / "model.safetensors")
        requantize(skeleton, state, quantization, device=torch.device("cpu"))
        if not any(key.startswith("lm_head.") for key in state):  # saved tied: share the embeddings again
            skeleton.get_output_embeddings().weight = skeleton.get_input_embeddings().weight
        return skeleton.to(target.device)
