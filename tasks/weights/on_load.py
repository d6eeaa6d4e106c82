"""`hf-quantize-on-load`: a bfloat16 transformers folder whose matrices torchao quantizes when the variant is loaded
on its device (`quantize-on-load.json` says how). torchao's int4 (tinygemm) and FP8 kernels pack weights for the
device they run on: tile-packed int4 and FP8 only on a CUDA GPU, int4 for the CPU's kernel on a CPU. The folder
holds the weights on the grid torchao's round-to-nearest lands on (GPTQ's levels survive it), so what is stored is
what runs; the packed bytes are what `quantize-on-load.json` counts for the roofline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import TargetError
from tasks.weights.registry import WeightsFormat, register

if TYPE_CHECKING:
    from tasks.config import RuntimeSettings, TargetConfig

ON_LOAD = "hf-quantize-on-load"
ON_LOAD_FILE = "quantize-on-load.json"
# torchao kernels behind the on-load methods, and the devices each packs for (tinygemm int4: tile-packed on CUDA,
# the CPU's own int4 pack on a CPU, the same grid; FP8 rows: CUDA only)
TINYGEMM_INT4, FP8_PER_ROW = "tinygemm_int4", "fp8_per_row"
ON_LOAD_KERNELS = {TINYGEMM_INT4: ("cpu", "cuda"), FP8_PER_ROW: ("cuda",)}


@register
class QuantizeOnLoad(WeightsFormat):
    name = ON_LOAD
    dtype = "bfloat16"  # torchao's int4 and FP8 kernels compute in bfloat16

    def save(self, model: Any, dest: Path, dtype: str, record: dict[str, Any] | None) -> None:
        import torch

        if record is None:
            raise ValueError("an on-load variant needs its quantize step's record")
        model.to(torch.bfloat16).save_pretrained(dest)  # exact: the grid was taken from the bfloat16 weights
        (dest / ON_LOAD_FILE).write_text(json.dumps({**record, **packed_bytes(model, record)}, indent=1))

    def load(self, folder: Path, dtype: str, settings: RuntimeSettings, target: TargetConfig) -> Any:
        """Read on the host and packed one matrix at a time on the device, so the device never holds the whole
        bfloat16 model (the first H200 check moved it whole and packed in place: a peak of 4.5 GB for a 0.5 GB
        int4 model whose bfloat16 form is 1.9 GB; this order has not been measured on a GPU yet)."""
        import torch
        from torchao.quantization import quantize_
        from transformers import AutoModelForCausalLM

        record = json.loads((folder / ON_LOAD_FILE).read_text())
        config = on_load_config(record, target.device)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, trust_remote_code=False)
        for module in dict.fromkeys(
            on_load_modules(model, record).values()
        ):  # each matrix once, in model order
            quantize_(module.to(target.device), config)
        return model.to(target.device)


def on_load_config(record: dict[str, Any], device: str) -> Any:
    """The torchao config an on-load record names, for `device` (the kernel packs for it)."""
    kernel = record["kernel"]
    if device.partition(":")[0] not in ON_LOAD_KERNELS[kernel]:
        raise TargetError(
            f"{kernel} runs on {', '.join(ON_LOAD_KERNELS[kernel])}, not {device} (torchao packs it for the device)"
        )
    if kernel == FP8_PER_ROW:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if device.startswith("cuda"):
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(group_size=record["group_size"], int4_packing_format="tile_packed_to_4d")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=record["group_size"])


def on_load_modules(model: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The linear layers an on-load record quantizes: every nn.Linear whose input splits into whole groups (FP8:
    16) and whose outputs are a multiple of 16 (the CPU's int4 pack and FP8 need it; the same layers on every
    device), except an output layer that shares its table with the embedding lookup."""
    import torch

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    multiple = record.get("group_size", 16)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module.in_features % multiple == 0
        and module.out_features % 16 == 0
        and not (tied and module is model.get_output_embeddings())
    }


def packed_bytes(model: Any, record: dict[str, Any]) -> dict[str, Any]:
    """Per device kind, the bytes each stored tensor takes once torchao has packed it there, keyed by the stored
    tensor's name, for the roofline (tensors left in bfloat16 keep their stored size). int4: half a byte a weight
    plus a bfloat16 scale and zero point per group, on CUDA of the matrix padded to inputs in multiples of 1024 and
    outputs in multiples of 8 (the tile-packed kernel reads the padding too); FP8: a byte a weight plus a float32
    scale per row."""

    def size(rows: int, columns: int, device: str) -> int:
        if record["kernel"] == FP8_PER_ROW:
            return rows * columns + rows * 4
        if device == "cuda":
            rows, columns = -(-rows // 8) * 8, -(-columns // 1024) * 1024
        return rows * columns // 2 + rows * (columns // record["group_size"]) * 4

    modules = on_load_modules(model, record)
    return {
        "packed_bytes": {
            device: {f"{name}.weight": size(*module.weight.shape, device) for name, module in modules.items()}
            for device in ON_LOAD_KERNELS[record["kernel"]]
        }
    }
