"""Target checks: what the configured hardware cannot run fails before any work starts, naming the alternative."""

from __future__ import annotations

import importlib.util

from tasks.config import RuntimeSettings
from tasks.errors import TargetError
from tasks.params import Config


def target_problems(config: Config, cuda_available: bool, cuda_devices: int | None = None) -> list[str]:
    """Every setting the target cannot honour, as 'key: why; alternative' lines (empty when all is runnable).
    `cuda_devices`: how many GPUs torch sees (default: one if `cuda_available`)."""
    target = config.target
    visible = (1 if cuda_available else 0) if cuda_devices is None else cuda_devices
    problems = _device_problems(config, visible)
    for name, variant in config.variants.items():
        problems += _runtime_problems(
            f"variants.{name}.runtime", variant.runtime, target.device, target.is_cuda
        )
        for index, step in enumerate(variant.steps):
            key = f"variants.{name}.steps[{index}].{step.kind}"
            problems += step.technique.problems(key, step.settings, config, cuda_available)
    return problems


def _device_problems(config: Config, visible: int) -> list[str]:
    target, problems = config.target, []
    if target.device == "hpu":
        problems.append(
            "target.device: hpu (Gaudi) needs optimum-habana, which llmopt does not drive; use cpu or cuda"
        )
    if target.is_cuda and visible == 0:
        problems.append(
            f"target.device: {target.device}, but no CUDA device is visible (torch sees none); use cpu"
        )
    elif target.is_cuda and target.cuda_index >= visible:
        problems.append(
            f"target.device: {target.device}, but torch sees {visible} CUDA device(s) (cuda:0…cuda:{visible - 1}); "
            "use one of them"
        )
    ranks = target.tensor_parallel
    if not target.is_cuda and ranks > 1:
        problems.append(
            f"target.tensor_parallel: {ranks} ranks need a multi-GPU cuda target (on a CPU the ranks would only "
            "share the same cores); use 1"
        )
    elif ranks > 1 and target.cuda_index != 0:
        problems.append(
            f"target.tensor_parallel: {ranks} ranks run on cuda:0…cuda:{ranks - 1}, not from {target.device}; "
            "set target.device: cuda"
        )
    elif ranks > visible > 0:
        problems.append(
            f"target.tensor_parallel: {ranks} ranks need {ranks} GPUs, torch sees {visible}; use "
            f"{visible if visible > 1 else 1}"
        )
    if ranks > 1:
        problems += _split_problems(config)
    return problems


def _split_problems(config: Config) -> list[str]:
    """What tensor parallelism cannot split: transformers shards float weights, with the default KV cache."""
    problems = []
    for name, variant in config.variants.items():
        for index, step in enumerate(variant.steps):
            if step.technique.role in ("quantize", "export"):
                problems.append(
                    f"variants.{name}.steps[{index}].{step.kind}: tensor parallelism splits float torch weights; "
                    "use runtime.dtype bfloat16 there, or target.tensor_parallel: 1"
                )
        unsplit = [
            key
            for key in ("kv_cache", "sliding_window", "wrapper", "compile", "speculative")
            if key in variant.runtime.model_fields_set
        ]
        if unsplit:
            problems.append(
                f"variants.{name}.runtime.{unsplit[0]}: not run with tensor parallelism by llmopt; leave it at its "
                "default, or target.tensor_parallel: 1"
            )
    return problems


def _runtime_problems(where: str, runtime: RuntimeSettings, device: str, cuda: bool) -> list[str]:
    problems = []
    if runtime.attention == "flash_attention_2" and not cuda:
        problems.append(f"{where}.attention: flash_attention_2 needs a cuda target, not {device}; use sdpa")
    elif runtime.attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        problems.append(
            f"{where}.attention: flash_attention_2 needs the flash-attn package, which is not installed (it has no "
            "wheel; transformers would fetch kernels from the hub, impossible offline); use sdpa"
        )
    if runtime.sdpa_backend in ("efficient", "cudnn") and not cuda:
        problems.append(
            f"{where}.attention: {runtime.attention} is a CUDA kernel of torch's SDPA, not on {device}; use "
            "sdpa_flash or sdpa_math (or sdpa: torch chooses)"
        )
    if runtime.dtype == "float16" and device == "cpu":
        problems.append(
            f"{where}.dtype: float16 has no fast matmul kernels on a cpu target (it runs slower than "
            "float32); use bfloat16"
        )
    if runtime.compile and not cuda:
        problems.append(
            f"{where}.compile: compiling the decode step with CUDA graphs needs a cuda target, not {device} "
            "(on this CPU torch.compile + static cache gave no gain for 80–110 s of compiling); use onnx_genai "
            "or llama_cpp for a fast CPU decoder"
        )
    if runtime.wrapper == "deepspeed" and cuda:
        problems.append(
            f"{where}.wrapper: deepspeed is set up for CPU inference here (world size 1, no kernel injection); "
            "on cuda leave wrapper at none"
        )
    return problems


def check_target(config: Config) -> None:
    """Raise one TargetError listing what the target cannot run (fail fast, never skip silently)."""
    import torch

    problems = target_problems(config, torch.cuda.is_available(), torch.cuda.device_count())
    if problems:
        more = f" (+{len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise TargetError(f"target {config.target.device}: {problems[0]}{more}")
