"""The hardware/software fingerprint attached to every benchmark result."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

from tasks.config import TargetConfig
from tasks.errors import ComparisonError

INTERESTING_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "fma",
)
PACKAGES = ("torch", "transformers", "onnxruntime", "onnxruntime-genai")


def machine_fingerprint(target: TargetConfig) -> dict[str, object]:
    """CPU model and flags, cores, the target's threads, memory, OS, Python and library versions, git commit; on a
    cuda target also the GPU (name, compute capability, memory, driver's CUDA version)."""
    threads, device = target.threads, target.device
    cpu = _cpuinfo()
    fingerprint: dict[str, object] = {
        "cpu_model": cpu.get("model name", platform.processor() or "unknown"),
        "cpu_flags": sorted(flag for flag in cpu.get("flags", "").split() if flag in INTERESTING_FLAGS),
        "cpu_cores": os.cpu_count() or 0,
        "threads": threads,
        "memory_gib": round(_memory_bytes() / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "gpu": gpu_facts(device) if device.startswith("cuda") else None,
        "git_commit": git_commit(Path.cwd()),
        "host": socket.gethostname(),  # where it ran (not part of the identity: same hardware, same hash)
    }
    fingerprint["hash"] = fingerprint_hash(fingerprint)
    return fingerprint


def gpu_facts(device: str) -> dict[str, object]:
    """What identifies the GPU a cuda target measures on."""
    import torch

    index = torch.device(device).index or 0
    properties = torch.cuda.get_device_properties(index)
    return {
        "name": properties.name,
        "capability": f"{properties.major}.{properties.minor}",
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
    }


def fingerprint_hash(fingerprint: dict[str, object]) -> str:
    """Identity of the measuring environment; the git commit and host name are excluded (code changes do not move
    hardware, and identical machines measure alike)."""
    stable = {k: v for k, v in fingerprint.items() if k not in ("hash", "git_commit", "host")}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def git_commit(folder: Path) -> str:
    """HEAD of the repository holding `folder` (marked `-dirty` with uncommitted changes), or 'unknown'."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=folder, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def ensure_comparable(previous: dict[str, object], current: dict[str, object]) -> None:
    """Refuse to compare speed measured in different environments, naming what differs."""
    if previous.get("hash") == current.get("hash"):
        return
    fields = sorted((set(previous) | set(current)) - {"hash", "git_commit", "host"})
    differences = [
        f"{name}: {previous.get(name)!r} → {current.get(name)!r}"
        for name in fields
        if previous.get(name) != current.get(name)
    ]
    raise ComparisonError(
        "refusing to compare benchmarks from different environments (fingerprint "
        f"{previous.get('hash')} vs {current.get('hash')}): " + "; ".join(differences or ["unknown fields"])
    )


def cuda_capability(device: str) -> tuple[int, int] | None:
    """The compute capability of the GPU a cuda target names (None where torch sees no such GPU)."""
    import torch

    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor
