"""Library chatter that tells an llmopt user nothing (missing optional CUDA kernels, deprecation notices)."""

from __future__ import annotations

import logging
import os
import warnings

NOISY_LOGGERS = (
    "transformers",
    "great_expectations",
    "torchao",  # "Failed to load …_C_cutlass_90a.so": CUDA kernels on a CPU machine
    "torch.utils._pytree",  # torchao's enum registration notices
    "DeepSpeed",
    "bitsandbytes",
)


def quiet_libraries() -> None:
    """Silence warnings and library loggers below ERROR (the CLI's --debug skips this)."""
    os.environ.setdefault(
        "DS_ACCELERATOR", "cpu"
    )  # llmopt's runtimes run on CPU; skips DeepSpeed's GPU probe
    os.environ.setdefault("TQDM_DISABLE", "1")  # library progress bars (weights loading, GX metrics)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    import torch  # noqa: F401  (torch configures its loggers on import; override them afterwards)

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
