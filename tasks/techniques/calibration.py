"""One calibration pass, shared by every technique that measures the model's inputs on the calibration split.

The calibration windows run through the model once with a forward hook on each named module; each call's input
rows (tokens × features) are reduced by a statistic and summed per module. GPTQ's Hessians (XᵀX), llama.cpp's
importance matrix (mean x²) and structured pruning's activation importance (mean |x|) are this one loop with a
different statistic. (optimum-quanto's `Calibration()` keeps its own hooks: it records into quanto's modules.)
Modules that read the same input (a layer's q/k/v, gate/up) compute each statistic of it once.

Captures are content-addressed: inside `statistics_cache(folder)` (the build opens one in the workdir)
a capture whose model weights, modules, windows and statistics are those of an earlier one is read back from
`folder` instead of run again, across variants (GPTQ's Hessians of the two int4 exports, the importance matrix of
the two llama.cpp files) and runs. Any changed weight, window or statistic gives another key. `cached_tensors`
puts any other per-weight statistic of the calibration windows under the same key (mixed precision's Fisher
diagonal).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import BuildError

WINDOW_TOKENS = 256  # tokens per calibration window, for every technique that calibrates
_CACHE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("statistics_cache", default=None)
_DEVICE: contextvars.ContextVar[str] = contextvars.ContextVar("calibration_device", default="cpu")


@contextlib.contextmanager
def statistics_cache(folder: Path | None) -> Iterator[None]:
    """Captures inside this block are stored in, and read back from, `folder` (None: not cached)."""
    token = _CACHE.set(folder)
    try:
        yield
    finally:
        _CACHE.reset(token)


@contextlib.contextmanager
def calibration_device(device: str) -> Iterator[None]:
    """Calibration inside this block runs on `device` (the build passes a cuda target's device) where torch sees
    it, else on the CPU: the capture's forward passes (the model moved there and back) and the per-matrix GPTQ
    rounding that asks `compute_device` (tasks/techniques/tinygemm_rounding.py). On a GPU that is seconds, where a
    ~1 B model's calibration took minutes on 16 host cores. Results come back to the CPU either way."""
    token = _DEVICE.set(device)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def compute_device() -> Any:
    """The torch device calibration runs on (see `calibration_device`)."""
    import torch

    device = torch.device(_DEVICE.get())
    return device if device.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def _on_compute_device(model: Any) -> Iterator[None]:
    """`model` on the compute device inside the block, back where it was after (and the GPU's cache emptied). A
    GPU without room for it: the block runs where the model is, as it always did, and the log says so."""
    import torch

    device, original = compute_device(), next(model.parameters()).device
    if device == original:
        yield
        return
    try:
        try:
            model.to(device)
        except torch.OutOfMemoryError:
            model.to(original)
            logging.getLogger(__name__).warning(
                f"calibration: {device} has no room for the model; on {original}"
            )
        yield
    finally:
        model.to(original)
        if device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class InputStatistics:
    """Per module: the statistic summed over every calibration token, and how many tokens that was."""

    sums: dict[str, Any]
    tokens: int

    def means(self) -> dict[str, Any]:
        """Per module: the statistic's mean per token."""
        return {name: total / self.tokens for name, total in self.sums.items()}


def capture_inputs(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    statistic: Callable[[Any], Any],
    progress: Callable[[int, int], None] | None = None,
) -> InputStatistics:
    """Run `windows` through `model` (eval mode, no gradients), summing `statistic(rows)` of each module's input,
    where rows is the input reshaped to (tokens, features); `progress(done, total)` after each window."""
    return capture_statistics(model, modules, windows, {"only": statistic}, progress)["only"]


def capture_statistics(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    statistics: dict[str, Callable[[Any], Any]],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, InputStatistics]:
    """`capture_inputs` with several statistics of the same inputs from one pass, by the statistics' names."""
    if not windows:
        raise BuildError("the calibration split gave no token windows (it is shorter than 8 tokens)")
    folder = _CACHE.get()
    if folder is None:
        return _capture(model, modules, windows, statistics, progress)
    path = folder / f"{capture_key(model, modules, windows, statistics)}.pt"
    if path.is_file():
        import torch

        stored = torch.load(path, weights_only=True, map_location="cpu")
        if progress is not None:
            progress(len(windows), len(windows))
        return {kind: InputStatistics(entry["sums"], int(entry["tokens"])) for kind, entry in stored.items()}
    found = _capture(model, modules, windows, statistics, progress)
    _store(
        path,
        {
            kind: {"sums": {n: t.cpu() for n, t in f.sums.items()}, "tokens": f.tokens}
            for kind, f in found.items()
        },
    )
    return found


def cached_tensors(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    code: Callable[..., Any],
    compute: Callable[[], dict[str, Any]],
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`compute()` (name → tensor, a statistic of `modules` over `windows` computed by `code` with `settings`), read
    back from the statistics cache when the model, modules, windows, settings and `code`'s source are those of an
    earlier call."""
    folder = _CACHE.get()
    if folder is None:
        return compute()
    key = capture_key(model, modules, windows, {code.__name__: code})
    if settings:
        key = hashlib.sha256(f"{key}\0{json.dumps(settings, sort_keys=True)}".encode()).hexdigest()
    path = folder / f"{key}.pt"
    if path.is_file():
        import torch

        return torch.load(path, weights_only=True, map_location="cpu")
    found = compute()
    _store(path, {name: tensor.detach().cpu() for name, tensor in found.items()})
    return found


def capture_key(
    model: Any, modules: dict[str, Any], windows: list[list[int]], statistics: dict[str, Callable[[Any], Any]]
) -> str:
    """Content address of a capture: every weight and buffer of the model, its config, the modules hooked (by name
    and the module they are), the windows' token ids, each statistic's code, this module's and the libraries'."""
    from importlib import metadata

    digest = hashlib.sha256()
    digest.update(Path(__file__).read_bytes())
    for package in ("torch", "transformers"):
        digest.update(f"{package}={metadata.version(package)}\0".encode())
    config = getattr(model, "config", None)
    digest.update((config.to_json_string() if config is not None else type(model).__name__).encode())
    for name, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        digest.update(_tensor_bytes(data))
    names = {id(module): name for name, module in model.named_modules()}
    digest.update(json.dumps([[key, names.get(id(module))] for key, module in modules.items()]).encode())
    digest.update(json.dumps(windows).encode())
    for kind, statistic in statistics.items():
        digest.update(f"{kind}\0{inspect.getsource(statistic)}".encode())
    return digest.hexdigest()


def _tensor_bytes(tensor: Any) -> bytes:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _store(path: Path, entries: dict[str, Any]) -> None:
    """Write atomically: a capture interrupted mid-write leaves no entry a later build would read."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        torch.save(entries, staging)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _capture(
    model: Any,
    modules: dict[str, Any],
    windows: list[list[int]],
    statistics: dict[str, Callable[[Any], Any]],
    progress: Callable[[int, int], None] | None,
) -> dict[str, InputStatistics]:
    import torch

    sums: dict[str, dict[str, Any]] = {kind: dict.fromkeys(modules, 0) for kind in statistics}
    last: list[Any] = [None, {}]  # the input tensor seen last and its statistics (q/k/v share one input)

    def hook(name: str) -> Callable[..., None]:
        def record(_module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
            if inputs[0] is not last[0]:
                rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
                last[0], last[1] = (
                    inputs[0],
                    {kind: statistic(rows) for kind, statistic in statistics.items()},
                )
            for kind, value in last[1].items():
                sums[kind][name] = sums[kind][name] + value

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
    try:
        model.eval()
        with torch.no_grad(), _on_compute_device(model):
            tokens = _run_windows(model, windows, last, progress)
    finally:
        for handle in handles:
            handle.remove()
    return {  # a module that never ran is left out; sums on the CPU wherever they were taken
        kind: InputStatistics({n: t.cpu() for n, t in totals.items() if not isinstance(t, int)}, tokens)
        for kind, totals in sums.items()
    }


def _run_windows(model: Any, windows: list[list[int]], last: list[Any], progress: Any) -> int:
    """Each window through `model` (the hooks record); the tokens run."""
    import torch

    tokens = 0
    for index, ids in enumerate(windows):
        model(input_ids=torch.tensor([ids], device=model.device))
        last[0], last[1] = None, {}
        tokens += len(ids)
        if progress is not None:
            progress(index + 1, len(windows))
    return tokens


def mean_square(rows: Any) -> Any:
    """Each input column's squared activation summed over tokens (llama.cpp's importance matrix), in float64."""
    rows = rows.double()
    return (rows * rows).sum(dim=0)


def mean_absolute(rows: Any) -> Any:
    """Each input column's |activation| summed over tokens (activation importance for structured pruning)."""
    return rows.abs().sum(0)


def unit_token_gram(rows: Any) -> Any:
    """XᵀX in float64 with every token's input scaled to unit length first (GPTQ's Hessian; see gptq_rounding.py why)."""
    rows = rows.double()
    rows = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return rows.T @ rows
