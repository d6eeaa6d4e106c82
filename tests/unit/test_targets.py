import pytest

from tasks.errors import TargetError
from tasks.params import Config
from tasks.targets import check_target, target_problems


def config(target: dict | None = None, **runtime) -> Config:
    return Config.model_validate(
        {"target": target or {}, "variants": {"baseline": {}, "v": {"runtime": runtime}}}
    )


def test_runnable_cpu_settings_raise_nothing():
    check_target(config(attention="eager", kv_cache="quantized", wrapper="deepspeed", dtype="bfloat16"))


@pytest.mark.parametrize(
    ("target", "runtime", "message"),
    [
        (
            {},
            {"attention": "flash_attention_2"},
            "variants.v.runtime.attention: flash_attention_2 needs a cuda",
        ),
        ({}, {"dtype": "float16"}, "variants.v.runtime.dtype: float16 has no fast matmul kernels"),
        ({}, {"attention": "sdpa_cudnn"}, "variants.v.runtime.attention: sdpa_cudnn is a CUDA kernel"),
        ({"tensor_parallel": 2}, {}, "target.tensor_parallel: 2 ranks need a multi-GPU cuda target"),
        ({"device": "hpu"}, {}, "target.device: hpu (Gaudi) needs optimum-habana"),
        ({"device": "cuda"}, {}, "target.device: cuda, but no CUDA device is visible (torch sees none)"),
        (
            {},
            {"kv_cache": "static", "compile": True},
            "variants.v.runtime.compile: compiling the decode step",
        ),
    ],
)
def test_what_the_target_cannot_run_fails_fast_naming_key_and_alternative(target, runtime, message):
    problems = target_problems(config(target, **runtime), cuda_available=False)
    assert len(problems) == 1 and problems[0].startswith(message)
    assert "use " in problems[0]
    with pytest.raises(TargetError, match="^target "):
        check_target(config(target, **runtime))


def test_gptqmodel_is_a_gpu_target_step():
    cfg = Config.model_validate(
        {
            "variants": {
                "baseline": {},
                "g": {"steps": [{"quantize": {"method": "gptqmodel", "group_size": 128}}]},
            }
        }
    )
    (problem,) = target_problems(cfg, cuda_available=False)
    assert problem.startswith("variants.g.steps[0].quantize.method: gptqmodel does not run on cpu")
    assert "onnx_genai int4" in problem


def test_every_problem_is_reported_at_once():
    with pytest.raises(TargetError, match=r"\(\+1 more: variants.v.runtime.attention"):
        check_target(config({"tensor_parallel": 4}, attention="flash_attention_2"))


def test_the_peer_row_needs_a_source_that_ships_a_gguf(tmp_path):
    def peer(source: str) -> Config:
        shipped = {"steps": [{"llama_cpp": {"type": "shipped"}}]}
        return Config.model_validate(
            {"model": {"source": source}, "variants": {"baseline": {}, "p": shipped}}
        )

    (problem,) = target_problems(peer("hf:org/model"), cuda_available=False)
    assert problem.startswith(
        "variants.p.steps[0].llama_cpp.type: shipped needs a model source that ships one"
    )
    (tmp_path / "m.Q4_0.gguf").write_bytes(b"GGUF")
    assert target_problems(peer(str(tmp_path)), cuda_available=False) == []


def test_a_cuda_target_runs_torch_variants_in_half_precision_and_refuses_what_it_cannot_run():
    cfg = Config.model_validate(
        {
            "target": {"device": "cuda:1"},
            "variants": {
                "baseline": {},
                "fp16": {"runtime": {"dtype": "float16"}},
                "bf16_static": {"runtime": {"dtype": "bfloat16", "kv_cache": "static"}},
                "onnx": {"steps": [{"onnx_genai": {"precision": "int4"}}]},
                "int8": {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}]},
                "flash": {"runtime": {"attention": "flash_attention_2", "dtype": "bfloat16"}},
            },
        }
    )
    problems = target_problems(cfg, cuda_available=True, cuda_devices=2)
    assert [problem.split(":")[0] for problem in problems] == [
        "variants.onnx.steps[0].onnx_genai",
        "variants.int8.steps[0].quantize.method",
        "variants.flash.runtime.attention",
    ]
    assert all("use " in problem for problem in problems)
    assert "flash-attn package, which is not installed" in problems[2]


def test_a_cuda_device_that_is_not_there_is_named_with_those_that_are():
    cfg = Config.model_validate({"target": {"device": "cuda:2"}, "variants": {"baseline": {}}})
    (problem,) = target_problems(cfg, cuda_available=True, cuda_devices=2)
    assert (
        problem == "target.device: cuda:2, but torch sees 2 CUDA device(s) (cuda:0…cuda:1); use one of them"
    )
    assert target_problems(cfg, cuda_available=True, cuda_devices=3) == []


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU"])
def test_a_device_llmopt_does_not_know_is_refused_by_the_schema(device):
    with pytest.raises(ValueError, match="device"):
        Config.model_validate({"target": {"device": device}, "variants": {"baseline": {}}})


def test_compile_needs_the_static_cache_it_replays_over():
    with pytest.raises(ValueError, match="compile replays the decode step over a fixed-shape cache"):
        config({"device": "cuda"}, compile=True)
    # the compiled loop masks its cache in every step; the flash kernel takes no mask
    with pytest.raises(ValueError, match="flash SDPA kernel takes no mask"):
        config({"device": "cuda"}, kv_cache="static", compile=True, attention="sdpa_flash")


def test_a_setting_added_later_keeps_the_build_keys_of_variants_that_leave_it_at_its_default():
    plain, compiled = config(), config(kv_cache="static", compile=True)
    assert "compile" not in plain.variants["v"].runtime.identity()
    assert compiled.variants["v"].runtime.identity()["compile"] is True


def _split(device: str, visible: int, **variant) -> list[str]:
    cfg = Config.model_validate(
        {"target": {"device": device, "tensor_parallel": 2}, "variants": {"baseline": {}, "v": variant}}
    )
    return target_problems(cfg, cuda_available=True, cuda_devices=visible)


def test_tensor_parallelism_runs_float_torch_variants_over_as_many_gpus_as_are_visible():
    assert _split("cuda", 2, runtime={"dtype": "bfloat16"}) == []
    (fewer,) = _split("cuda", 1)
    assert fewer == "target.tensor_parallel: 2 ranks need 2 GPUs, torch sees 1; use 1"
    (offset,) = _split("cuda:1", 4)
    assert offset.startswith("target.tensor_parallel: 2 ranks run on cuda:0…cuda:1, not from cuda:1")
    (quantized,) = _split("cuda", 2, steps=[{"quantize": {"method": "torchao_int8_weight_only"}}])
    assert quantized.startswith("variants.v.steps[0].quantize: tensor parallelism splits float torch weights")
    (compiled,) = _split("cuda", 2, runtime={"kv_cache": "static", "compile": True})
    assert compiled.startswith("variants.v.runtime.kv_cache: not run with tensor parallelism")
    (speculative,) = _split("cuda", 2, runtime={"speculative": {"method": "ngram"}})
    assert speculative.startswith("variants.v.runtime.speculative: not run with tensor parallelism")
