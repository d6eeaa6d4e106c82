import pytest

from tasks.config import Config
from tasks.errors import TargetError
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
        ({"tensor_parallel": 2}, {}, "target.tensor_parallel: 2 ranks need a multi-GPU cuda target"),
        ({"device": "hpu"}, {}, "target.device: hpu (Gaudi) needs optimum-habana"),
        ({"device": "cuda"}, {}, "target.device: cuda, but this machine has no CUDA GPU"),
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
    assert problem.startswith("variants.g.steps[0].quantize.method: gptqmodel needs a cuda target")
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
