"""The GPU check's CPU mode (`make gpu-check-cpu`), so the script a borrowed GPU runs cannot rot: every technique
that can run on a CPU runs through llmopt's build, engine and benchmark, the CUDA-only ones are skipped with their
reason, and the logits comparison tells 8-bit from 4-bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What llmopt's pre-flight refuses on a CPU target (the script asks it, so this list is the check on both)
CPU_REFUSED = {
    "fp16": "float16 has no fast matmul kernels",
    "bf16_static_kv_compiled": "compiling the decode step with CUDA graphs needs a cuda target",
    "sdpa_efficient": "a CUDA kernel of torch's SDPA",
    "sdpa_cudnn": "a CUDA kernel of torch's SDPA",
    "torchao_fp8_per_row": "FP8 matmuls need a GPU of compute capability 8.9",
    "torchao_fp8_per_row_compiled": "compiling the decode step with CUDA graphs needs a cuda target",
    "torchao_int4_gptq_compiled": "compiling the decode step with CUDA graphs needs a cuda target",
    "torchao_int4_tinygemm_compiled": "compiling the decode step with CUDA graphs needs a cuda target",
    "torchao_int8_weight_only_compiled": "compiling the decode step with CUDA graphs needs a cuda target",
    "tensor_parallel_2": "ranks need a multi-GPU cuda target",
    "served_bf16_compiled": "compiling the decode step with CUDA graphs needs a cuda target",
}


def test_the_gpu_check_runs_every_cpu_capable_technique_and_names_why_the_others_did_not(tmp_path):
    sys.path.insert(0, str(REPO / "infra"))
    from gpu_check import CHECKS

    out = tmp_path / "gpu-check.json"
    script = [sys.executable, str(REPO / "infra" / "gpu_check.py"), "--cpu", "--tiny", "--out", str(out)]
    subprocess.run(script, check=True, capture_output=True, timeout=900)
    report = json.loads(out.read_text())
    results = {result["technique"]: result for result in report["results"]}
    assert [check.technique for check in CHECKS] == list(results)
    tiers = [result["tier"] for result in report["results"]]
    assert (
        tiers == sorted(tiers) and tiers[0] == 1 and results["fp32"]["tier"] == 1
    )  # the headline runs first
    assert report["device"]["kind"] == "cpu" and report["model"]["parameters"] > 0
    for check in CHECKS:
        result = results[check.technique]
        if check.technique in CPU_REFUSED:
            assert result["status"] == "skipped" and CPU_REFUSED[check.technique] in result["reason"], result
        elif not check.timed:  # the reference: its logits, no benchmark
            assert result["status"] == "ran" and "decode_tok_s" not in result, result
        else:
            assert result["status"] == "ran", result
            assert list(result["decode_tok_s"]) == [str(size) for size in check.batches], result
            assert all(speed > 0 for speed in result["decode_tok_s"].values()) and result["bytes_per_step"]
    served = results["served_bf16"]["served"]  # over HTTP to the app in process, and the same replay offline
    assert served["clients"] == 16 and served["http_share_of_offline"] > 0, served
    assert all(served[way]["errors"] == 0 and served[way]["tok_s"] > 0 for way in ("http", "offline")), served
    error = {name: r["logits_vs_fp32"]["rel_l2"] for name, r in results.items() if "logits_vs_fp32" in r}
    assert set(error) == {name for name, r in results.items() if r["status"] == "ran"} - {"fp32"}
    assert error["bf16"] < 0.02 and error["torchao_int8_weight_only"] < 0.05 and error["bnb_int8"] < 0.05
    assert 0.02 < error["torchao_int4_weight_only"] < 0.5 and 0.02 < error["bnb_nf4"] < 0.5
    assert 0.02 < error["torchao_int4_tinygemm"] < 0.5 and 0.02 < error["torchao_int4_gptq"] < 0.5
    packed, stored = results["torchao_int4_tinygemm"]["bytes_per_step"], results["bf16"]["bytes_per_step"]
    assert packed < 0.6 * stored  # the roofline counts int4 as packed on the device, not the bfloat16 on disk


def test_the_gpu_check_exits_non_zero_when_a_technique_it_ran_failed(tmp_path, monkeypatch):
    """A failed technique is a defect to look at: the script says so on stderr and exits 1 (a skip, which names the
    missing hardware, package or deadline, does not)."""
    sys.path.insert(0, str(REPO / "infra"))
    import gpu_check

    real = gpu_check._measure

    def measure(check, *args):
        if check.technique == "bf16":
            raise RuntimeError("a kernel that is not there")
        return real(check, *args)

    monkeypatch.setattr(gpu_check, "_measure", measure)
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--cpu", "--tiny", "--only", "bf16,tensor_parallel_2", "--out", str(out)]) == 1
    results = {r["technique"]: r for r in json.loads(out.read_text())["results"]}
    assert results["bf16"]["status"] == "failed" and "a kernel that is not there" in results["bf16"]["reason"]
    assert results["tensor_parallel_2"]["status"] == "skipped"
    monkeypatch.setattr(gpu_check, "_measure", real)
    assert gpu_check.main(["--cpu", "--tiny", "--only", "tensor_parallel_2", "--out", str(out)]) == 0
