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


def output_to_log_file() -> None:
    """In a spawned helper process (the benchmark): its stdout and stderr, C libraries' included, go to the
    command's log file when the CLI keeps one (`$LLMOPT_LOG_FILE`; not with --debug). Its result and errors
    travel back to the parent, which reports them."""
    path = os.environ.get("LLMOPT_LOG_FILE")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
