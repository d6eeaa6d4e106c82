"""Target checks: what the configured hardware cannot run fails before any work starts, naming the alternative."""

from __future__ import annotations

from tasks.config import Config
from tasks.errors import TargetError


def target_problems(config: Config, cuda_available: bool) -> list[str]:
    """Every setting the target cannot honour, as 'key: why; alternative' lines (empty when all is runnable)."""
    target = config.target
    problems = []
    if target.device == "hpu":
        problems.append(
            "target.device: hpu (Gaudi) needs optimum-habana, which llmopt does not drive; use cpu or cuda"
        )
    if target.device == "cuda":
        problems.append(
            "target.device: cuda"
            + ("" if cuda_available else ", but this machine has no CUDA GPU (torch sees none);")
            + " llmopt's runtimes place models on the CPU only so far (untested on GPUs); use cpu"
        )
    if target.device != "cuda" and target.tensor_parallel > 1:
        problems.append(
            f"target.tensor_parallel: {target.tensor_parallel} ranks need a multi-GPU cuda target "
            "(DeepSpeed AutoTP on CPU crashes at 2 ranks); use 1"
        )
    for name, variant in config.variants.items():
        where, runtime = f"variants.{name}.runtime", variant.runtime
        if runtime.attention == "flash_attention_2" and target.device != "cuda":
            problems.append(
                f"{where}.attention: flash_attention_2 needs a cuda target, not {target.device}; use sdpa"
            )
        if runtime.dtype == "float16" and target.device == "cpu":
            problems.append(
                f"{where}.dtype: float16 has no fast matmul kernels on a cpu target (it runs slower than "
                "float32); use bfloat16"
            )
        for index, step in enumerate(variant.steps):
            key = f"variants.{name}.steps[{index}].{step.kind}"
            problems += step.technique.problems(key, step.settings, config, cuda_available)
    return problems


def check_target(config: Config) -> None:
    """Raise one TargetError listing what the target cannot run (fail fast, never skip silently)."""
    import torch

    problems = target_problems(config, torch.cuda.is_available())
    if problems:
        more = f" (+{len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise TargetError(f"target {config.target.device}: {problems[0]}{more}")
