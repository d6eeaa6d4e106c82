"""The GPU check: every technique llmopt can try on a device, built, loaded and measured by llmopt's own build,
engine and benchmark code, on a generated Llama (nothing is downloaded), written stage by stage to JSON.

    python infra/gpu_check.py                 # a CUDA machine: a ~1 B-parameter Llama on cuda (`make gpu-check`)
    python infra/gpu_check.py --cpu --tiny    # CI: a tiny Llama on the CPU (`make gpu-check-cpu`)

It needs only torch, transformers and pydantic besides the source tree (optional: torchao, bitsandbytes,
optimum-quanto; a technique whose package is missing is `skipped` with that reason), so it runs on a bare CUDA
image with a few carried wheels. An internal deadline (`--deadline-s`) keeps one run inside the time a borrowed
GPU allows; techniques not reached are `skipped` with the reason. They run in tiers, so one loan always yields the
headline: tier 1 is the fp32 reference's logits, the compiled decode loop in bf16, int8 and int4, and the request
mix served at 16 clients through the scheduler and its compiled decoder; then FP8, bitsandbytes, the SDPA kernels,
GPTQ and the eager rows (the eager served replay among them)
(`--only a,b` runs the ones a loan did not reach). Output: `gpu-check.json` or $GPU_CHECK_OUT. Exit status 1 when
a technique that ran failed (a skip names the missing hardware, package or the deadline).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # llmopt's modules from this source tree
from generated_llama import GeneratedBase, generated_llama  # noqa: E402  (beside this script)


@dataclass(frozen=True)
class Check:
    """One technique to try: its recipe and the packages it needs. Whether the device can run it is llmopt's own
    pre-flight answer (tasks.targets), so the script skips what `llmopt run` would refuse, with the same line.
    `served`: also replay a request mix through the server's scheduler at 16 clients (`SERVED_CLIENTS`)."""

    technique: str
    recipe: dict[str, Any]
    packages: tuple[str, ...] = ()
    ranks: int = 1  # target.tensor_parallel
    tier: int = 2  # tier 1 runs first: one loan always yields the headline rows
    served: bool = False
    timed: bool = (
        True  # False: logits and memory only (the fp32 reference: its eager speed is in tier 2's rows)
    )
    batches: tuple[int, ...] = (1, 8)  # each one more compile of a compiled loop (~30-60 s on a ~1 B model)


def _quantize(method: str, **settings: Any) -> dict[str, Any]:
    return {"steps": [{"quantize": {"method": method, **settings}}]}


def _compiled(check: Check) -> Check:
    """The same technique decoded by llmopt's compiled loop (tasks/engines/pytorch/decode_loop.py)."""
    runtime = {**check.recipe.get("runtime", {}), **COMPILED}
    return replace(
        check, technique=f"{check.technique}_compiled", recipe={**check.recipe, "runtime": runtime}
    )


TORCHAO, BNB = ("torchao",), ("bitsandbytes", "accelerate")
COMPILED = {"kv_cache": "static", "compile": True}
SERVED_CLIENTS = 16
BF16 = Check("bf16", {"runtime": {"dtype": "bfloat16"}}, tier=1)
INT8 = Check("torchao_int8_weight_only", _quantize("torchao_int8_weight_only"), TORCHAO)
INT4 = Check("torchao_int4_tinygemm", _quantize("torchao_int4_tinygemm"), TORCHAO)
FP8 = Check("torchao_fp8_per_row", _quantize("torchao_fp8_per_row"), TORCHAO)
GPTQ = Check("torchao_int4_gptq", _quantize("torchao_int4_gptq", calibration_windows=8), TORCHAO)
CHECKS = tuple(
    sorted(
        (
            # the reference every other technique's logits are compared with; eager speeds are tier 2's: a
            # launch-bound eager benchmark of the ~1 B model took a minute of the first H100 loan each
            Check("fp32", {}, tier=1, timed=False),
            # eager decoding of a ~1 B model is launch-bound on a GPU (the first H200 check: 1-3 % of the roofline);
            # the compiled loop is what `runtime.compile: true` means there, and what a quantized matrix pays in
            replace(_compiled(BF16), technique="bf16_static_kv_compiled"),
            replace(_compiled(INT8), tier=1, batches=(1,)),
            replace(_compiled(INT4), tier=1, batches=(1,)),
            # the server's compiled decoder (tasks/engines/pytorch/graph_slots.py): its buckets compile at the
            # scheduler's start at the shortest span (longer spans compile when a row first needs them)
            replace(_compiled(BF16), technique="served_bf16_compiled", served=True, batches=(1,)),
            _compiled(FP8),
            Check("bnb_nf4", _quantize("bnb_nf4", compute_dtype="bfloat16"), BNB),
            Check("bnb_fp4", _quantize("bnb_fp4", compute_dtype="bfloat16"), BNB),
            Check("bnb_int8", _quantize("bnb_int8"), BNB),
            Check("sdpa_flash", {"runtime": {"attention": "sdpa_flash", "dtype": "bfloat16"}}),
            Check("sdpa_efficient", {"runtime": {"attention": "sdpa_efficient", "dtype": "bfloat16"}}),
            Check("sdpa_cudnn", {"runtime": {"attention": "sdpa_cudnn", "dtype": "bfloat16"}}),
            _compiled(GPTQ),
            replace(BF16, tier=2),
            replace(
                BF16, technique="served_bf16", served=True, tier=2
            ),  # the padded eager batch, for comparison
            Check("fp32_timed", {}),
            INT8,
            INT4,
            FP8,
            GPTQ,
            Check("fp16", {"runtime": {"dtype": "float16"}}),
            Check("bf16_static_kv", {"runtime": {"dtype": "bfloat16", "kv_cache": "static"}}),
            Check("eager_attention", {"runtime": {"attention": "eager"}}),
            Check("torchao_int8_dynamic", _quantize("torchao_int8_dynamic"), TORCHAO),
            Check("torchao_int4_weight_only", _quantize("torchao_int4_weight_only"), TORCHAO),
            Check("quanto_w8a16", _quantize("quanto_w8a16"), ("optimum-quanto",)),
            Check("tensor_parallel_2", {"runtime": {"dtype": "bfloat16"}}, ranks=2),
        ),
        key=lambda check: check.tier,  # stable: within a tier, the order above
    )
)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    from tasks.quiet import quiet_libraries

    quiet_libraries()  # library warnings, loggers and progress bars: the JSON is the output
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    device = "cpu" if args.cpu else "cuda"
    # inductor's compiled kernels land in the work folder, so a loan can carry them to the next one (docs/development.md)
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".llmopt" / "inductor")
    )
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch sees none); use --cpu", file=sys.stderr)
        return 2
    started, out = time.monotonic(), Path(args.out)
    report: dict[str, Any] = {"device": _device_facts(device), "model": {}, "results": []}
    _write(out, report)
    with tempfile.TemporaryDirectory(prefix="llmopt-gpu-check-") as scratch:
        base = generated_llama(Path(scratch) / "base", tiny=args.tiny)
        report["model"] = base.facts
        _write(out, report)
        reference = None
        chosen = {"fp32", *filter(None, args.only.split(","))} if args.only else None
        for check in CHECKS:
            if chosen is not None and check.technique not in chosen:
                continue
            left = args.deadline_s - (time.monotonic() - started)
            result = _run_check(check, base, device, Path(scratch), reference, left, args.tiny)
            if check.technique == "fp32" and result["status"] != "ran":
                print(f"gpu-check: the fp32 reference failed: {result.get('reason')}", file=sys.stderr)
            if check.technique == "fp32" and result["status"] == "ran":
                reference = result.pop("_logits")
            result.pop("_logits", None)
            report["results"].append(result)
            _write(out, report)  # stage by stage: a run cut short still leaves every finished technique
            print(f"gpu-check: {check.technique}: {result['status']} {result.get('reason', '')}".rstrip())
    report["seconds"] = round(time.monotonic() - started, 1)
    _write(out, report)
    failed = [result["technique"] for result in report["results"] if result["status"] == "failed"]
    if failed:  # a skip names missing hardware, a package or the deadline; a failure is a defect to look at
        print(f"gpu-check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (CUDA-only techniques skipped)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (seconds), not ~1 B parameters")
    parser.add_argument("--only", default="", help="techniques to run, comma-separated (fp32 always runs)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="stop starting techniques after this")
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "gpu-check.json"), help="the JSON")
    return parser.parse_args(argv)


def _run_check(
    check: Check, base: GeneratedBase, device: str, scratch: Path, reference: Any, left_s: float, tiny: bool
) -> dict[str, Any]:
    result: dict[str, Any] = {"technique": check.technique, "tier": check.tier, "recipe": check.recipe}
    missing = [package for package in check.packages if not _installed(package)]
    reason = (
        _refused(check, device)
        or (f"needs {', '.join(missing)}, not installed" if missing else None)
        or ("the deadline was reached before it started" if left_s <= 0 else None)
    )
    if reason:
        return {**result, "status": "skipped", "reason": reason}
    try:
        return {**result, "status": "ran", **_measure(check, base, device, scratch, reference, tiny)}
    except Exception as exc:  # one technique's failure is its result, not the end of the check
        trace = traceback.format_exception(exc)[-3:]
        return {**result, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:500], "trace": trace}
    finally:  # a ~1 B variant is up to 4 GB: twenty of them would not fit a borrowed machine's disk
        shutil.rmtree(scratch / check.technique, ignore_errors=True)


def _refused(check: Check, device: str) -> str | None:
    """llmopt's pre-flight line for this recipe on `device` (None: `llmopt run` would run it)."""
    import torch

    from tasks.params import Config
    from tasks.targets import target_problems

    target = {"device": device, "tensor_parallel": check.ranks}
    config = Config.model_validate(
        {"target": target, "variants": {"baseline": {}, check.technique: check.recipe}}
    )
    problems = target_problems(config, torch.cuda.is_available(), torch.cuda.device_count())
    return "; ".join(problem.split(": ", 1)[1] for problem in problems) or None


def _measure(
    check: Check, base: GeneratedBase, device: str, scratch: Path, reference: Any, tiny: bool
) -> dict:
    import torch

    from tasks.config import BenchmarkConfig, TargetConfig
    from tasks.engines import load_runtime
    from tasks.measure.benchmark import benchmark_variant, memory_read_bandwidth_gbs, roofline_fraction
    from tasks.params import VariantConfig
    from tasks.techniques.build import build_variant

    started = time.perf_counter()
    folder = scratch / check.technique
    build_variant(
        check.technique,
        VariantConfig.model_validate(check.recipe),
        base.prepared,
        "generated",
        folder,
        calibration=base.calibration,
        device=device,
    )
    build_s = time.perf_counter() - started
    target = TargetConfig(device=device, threads=os.cpu_count() or 1, tensor_parallel=check.ranks)
    held = _gpu_mb(device, reset_peak=True)
    runtime = load_runtime(folder, target)
    # the weights as they sit on the device, and the most the load held at once (quantizing on the device)
    after_load, load_peak = (
        (None, None) if held is None else (_gpu_mb(device) - held, _gpu_mb(device, True) - held)
    )
    logits = runtime.logits(base.probe)
    getattr(runtime, "close", lambda: None)()  # a split model's other ranks stop before the benchmark starts
    del runtime
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # the benchmark's peak starts from its own load
    if not check.timed:
        loaded = {"gpu_mb_after_load": _rounded(after_load), "gpu_mb_peak_in_load": _rounded(load_peak)}
        return {"build_s": round(build_s, 2), **loaded, "_logits": logits}
    cfg = BenchmarkConfig(
        prompt_tokens=32 if tiny else 128,
        new_tokens=8 if tiny else 32,
        batch_sizes=list(check.batches),
        ttft_prompt_tokens=[32],
        requests=2,
        request_new_tokens=4,
        repeats=2,
    )
    plan = _served_plan(base, tiny) if check.served else None
    cfg = cfg.model_copy(update={"served_clients": [SERVED_CLIENTS] if plan else []})
    skips = _cudagraph_skips()
    measured = benchmark_variant(folder, cfg, " ".join(["river stone garden"] * 20), target, plan)
    bandwidth = memory_read_bandwidth_gbs(target, megabytes=64 if tiny else 512)
    result = {
        "build_s": round(build_s, 2),
        "ttft_ms": round(measured.ttft_ms, 2),
        "decode_tok_s": {str(b.batch_size): round(b.decode_tok_s, 1) for b in measured.batches},
        "peak_gpu_mb": None if measured.peak_gpu_mb is None else round(measured.peak_gpu_mb, 1),
        "gpu_mb_after_load": _rounded(after_load),
        "gpu_mb_peak_in_load": _rounded(load_peak),
        "peak_rss_mb": round(measured.peak_rss_mb, 1),
        "bytes_per_step": measured.decode_read_bytes,
        "bandwidth_gbs": round(bandwidth, 1),
        "bandwidth_share": round(
            roofline_fraction(measured.decode_tok_s, measured.decode_read_bytes, bandwidth), 4
        ),
        "first_call_s": round(measured.first_call_s, 2),
        "compile_s": None if measured.compile_s is None else round(measured.compile_s, 2),
        # a compiled step that fell back from CUDA graphs (a mutated input, a CPU tensor) runs slow and says so here
        "cudagraph_skips": _cudagraph_skips() - skips,
        "_logits": logits,
    }
    if measured.served:
        result["served"] = _served(measured.served[0], folder, target, plan)
    if reference is not None:
        difference = (logits - reference).norm() / reference.norm()
        result["logits_vs_fp32"] = {
            "rel_l2": round(float(difference), 6),
            "max_abs": round(float((logits - reference).abs().max()), 4),
            "argmax_agreement": round(float((logits.argmax(-1) == reference.argmax(-1)).float().mean()), 4),
        }
    return result


def _served(offline: Any, folder: Path, target: Any, plan: Any) -> dict[str, Any]:
    """The plan's requests from `SERVED_CLIENTS` streaming clients over HTTP to `llmopt serve`'s app in this process
    (serving/in_process.py), beside the same requests replayed offline through the same scheduler settings (the
    benchmark's served replay, `offline`): the offline figure is the served one's ceiling."""
    from serving.in_process import level_figures, served_over_http
    from tasks.engines import load_runtime

    runtime = load_runtime(folder, target)
    try:
        http = served_over_http(runtime, plan.requests, SERVED_CLIENTS, plan.limits)
    finally:
        getattr(runtime, "close", lambda: None)()
    return {
        "how": "every request to its budget; http: streamed to the app on loopback; offline: the scheduler alone",
        "clients": SERVED_CLIENTS,
        "http": level_figures(http),
        "offline": level_figures(offline),
        "http_share_of_offline": round(http.tok_s / offline.tok_s, 3) if offline.tok_s else None,
    }


def _served_plan(base: GeneratedBase, tiny: bool) -> Any:
    """The load test's request mix over the generated sentences (seeded), 2 requests per client, through `serve`'s
    default scheduler settings with room for every client."""
    from serving.models import Limits
    from tasks.config import LoadtestConfig
    from tasks.measure.served import ServedPlan, request_set

    mix = LoadtestConfig(requests_per_level=2 * SERVED_CLIENTS)
    requests = request_set(base.calibration, mix, 16 if tiny else 64)
    return ServedPlan(tuple(requests), Limits(max_batch=SERVED_CLIENTS, max_queue=4 * SERVED_CLIENTS))


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _gpu_mb(device: str, peak: bool = False, reset_peak: bool = False) -> float | None:
    """MiB the process holds on the GPU now, or the most it held since the last reset (None on the CPU)."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    held = (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**20
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    return held


def _device_facts(device: str) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    facts: dict[str, Any] = {
        "kind": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device == "cuda":
        from tasks.measure.fingerprint import gpu_facts

        facts |= {**gpu_facts(device), "count": torch.cuda.device_count()}
    else:
        facts["name"] = platform.processor() or platform.machine()
    return facts


def _installed(package: str) -> bool:
    return (
        importlib.util.find_spec(package.replace("-", "_").replace("optimum_quanto", "optimum.quanto"))
        is not None
    )


def _write(out: Path, report: dict[str, Any]) -> None:
    staged = out.with_name(out.name + ".partial")
    staged.write_text(json.dumps(report, indent=2) + "\n")
    staged.replace(out)


if __name__ == "__main__":
    sys.exit(main())
