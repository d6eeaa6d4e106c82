import json
import re
from pathlib import Path

import pytest
import yaml

from tasks.config import RuntimeSettings
from tasks.engines.onnx.export import OnnxGenAIStep
from tasks.errors import ConfigError
from tasks.params import Config, VariantConfig
from tasks.params_file import load_config
from tasks.techniques.distill import DistillStep
from tasks.techniques.prune import PruneStep
from tasks.techniques.quantize.methods import METHODS
from tasks.techniques.quantize.step import QuantizeStep

REPO = Path(__file__).resolve().parents[2]
MINIMAL = "variants:\n  baseline: {}\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_repository_params_files_load_and_the_full_profile_keeps_what_the_default_dropped():
    config = load_config(REPO / "params.yaml")
    assert set(config.variants) == {
        "baseline",
        "onnx_int8",
        "onnx_int4_mixed",
        "llama_q4_0_mixed",
        "gguf_shipped",
    }
    mixed = config.variants["onnx_int4_mixed"].steps[0].onnx_genai
    assert (mixed.scales, mixed.mixed_precision.sensitivity) == ("weighted", "measured")
    full = load_config(REPO / "params.full.yaml")
    moved = {"bf16", "int8_dynamic", "onnx_int4", "onnx_int4_gptq", "pruned_onnx_int8", "distilled_onnx_int8"}
    moved |= {"onnx_int4_weighted", "llama_q4_k_m"}
    assert set(full.variants) >= set(config.variants) | moved
    assert full.variants["int8_dynamic"].steps[0].kind == "quantize"


def test_minimal_file_gets_documented_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.model.source == "smollm2"
    assert config.tracking.uri == "sqlite:///mlflow.db"
    assert config.select.max_ppl_increase == 0.05


def test_unknown_key_names_its_path_and_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, MINIMAL + "evaluate:\n  windw: 128\n"))
    message = str(error.value)
    assert message.startswith("params.yaml: evaluate.windw: unknown key")
    assert "did you mean 'window'" in message
    assert "\n" not in message


def test_unknown_key_inside_a_variant_step_is_located(tmp_path):
    text = "variants:\n  baseline: {}\n  q:\n    steps:\n      - quantize: {method: torch_dynamic_int8, bitz: 3}\n"
    with pytest.raises(
        ConfigError, match=r"variants\.q\.steps\[0\]\.quantize\.bitz: unknown key \(did you mean 'bits'\?\)"
    ):
        load_config(write(tmp_path, text))


def test_wrong_type_is_refused_not_coerced(tmp_path):
    with pytest.raises(ConfigError, match=r"evaluate\.window: Input should be a valid integer, got '512'"):
        load_config(write(tmp_path, MINIMAL + "evaluate:\n  window: '512'\n"))


def test_impossible_value_names_the_bound(tmp_path):
    with pytest.raises(
        ConfigError, match=r"select\.max_ppl_increase: Input should be greater than or equal to 0"
    ):
        load_config(write(tmp_path, MINIMAL + "select:\n  max_ppl_increase: -0.1\n"))


def test_baseline_must_exist_and_be_plain_fp32(tmp_path):
    with pytest.raises(ConfigError, match="not in variants"):
        load_config(write(tmp_path, "variants:\n  fast: {}\n"))
    with pytest.raises(ConfigError, match="must be fp32 with no steps"):
        load_config(write(tmp_path, "variants:\n  baseline: {runtime: {dtype: bfloat16}}\n"))


def test_a_step_must_name_exactly_one_technique():
    with pytest.raises(ValueError, match="exactly one technique"):
        VariantConfig.model_validate({"steps": [{}]})


def test_dynamic_int8_in_bf16_is_refused():
    with pytest.raises(ValueError, match="quantize steps set their own compute precision"):
        VariantConfig.model_validate(
            {"steps": [{"quantize": {"method": "torch_dynamic_int8"}}], "runtime": {"dtype": "bfloat16"}}
        )


@pytest.mark.parametrize(
    ("steps", "runtime", "message"),
    [
        ([{"onnx_genai": {}}, {"quantize": {"method": "torch_dynamic_int8"}}], {}, "must be the last step"),
        ([{"quantize": {"method": "torch_dynamic_int8"}}, {"onnx_genai": {}}], {}, "exports a float model"),
        ([{"onnx_genai": {}}], {"dtype": "bfloat16"}, "sets its own precision"),
    ],
)
def test_onnx_export_must_compose_sensibly(steps, runtime, message):
    with pytest.raises(ValueError, match=message):
        VariantConfig.model_validate({"steps": steps, "runtime": runtime})


def test_onnx_block_size_outside_the_builder_choices_is_refused(tmp_path):
    text = MINIMAL + "  q:\n    steps:\n      - onnx_genai: {precision: int4, block_size: 48}\n"
    with pytest.raises(
        ConfigError, match=r"variants\.q\.steps\[0\]\.onnx_genai\.block_size: Input should be 16, 32"
    ):
        load_config(write(tmp_path, text))


def test_invalid_yaml_and_missing_file_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "variants: [\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.yaml")


def test_recipe_hash_ignores_the_variant_name_but_not_the_recipe():
    config = Config.model_validate(
        {"variants": {"baseline": {}, "copy": {}, "half": {"runtime": {"dtype": "bfloat16"}}}}
    )
    hashes = {name: variant.recipe_hash() for name, variant in config.variants.items()}
    assert hashes["baseline"] == hashes["copy"] != hashes["half"]


def test_benchmark_without_batch_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"benchmark: batch_sizes must include 1"):
        load_config(write(tmp_path, MINIMAL + "benchmark:\n  batch_sizes: [4, 8]\n"))


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("runtime: {kv_cache_bits: 2}", "kv_cache_bits applies only with kv_cache: quantized"),
        (
            "steps: [{onnx_genai: {precision: int8}}]\n    runtime: {attention: eager}",
            "runtime.attention applies to the torch engine",
        ),
        ("runtime: {sliding_window: 4}", "greater than or equal to 8"),
    ],
)
def test_runtime_settings_that_cannot_apply_are_refused(tmp_path, variant, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, f"{MINIMAL}  v:\n    {variant}\n"))


def test_unset_runtime_settings_keep_existing_recipe_hashes():
    assert VariantConfig().recipe() == {"steps": [], "runtime": {"dtype": "float32"}}


RECORDED = json.loads((Path(__file__).with_name("recipe_hashes_69b38b0.json")).read_text())


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recipe_hashes_equal_those_recorded_before_defaults_moved_onto_the_config(name):
    """Hashes recorded at commit 69b38b0 (defaults as `None` + fallbacks in the code) for every variant of
    params.full.yaml and recipes that leave step defaults unset or spell them out."""
    assert VariantConfig.model_validate(RECORDED[name]["recipe"]).recipe_hash() == RECORDED[name]["hash"]


def test_spelling_out_a_default_is_part_of_the_recipe_but_builds_the_same_settings():
    implicit = VariantConfig.model_validate({"steps": [{"prune": {"method": "unstructured"}}]})
    explicit = VariantConfig.model_validate(
        {"steps": [{"prune": {"method": "unstructured", "sparsity": 0.5, "scope": "global"}}]}
    )
    assert implicit.recipe_hash() != explicit.recipe_hash()  # the hash is of what the user wrote
    assert implicit.steps[0].prune == explicit.steps[0].prune  # the same settings either way
    assert (implicit.steps[0].prune.sparsity, implicit.steps[0].prune.scope) == (0.5, "global")


def test_step_defaults_are_declared_on_the_config_models_and_none_only_means_off():
    sections = (QuantizeStep, OnnxGenAIStep, PruneStep, DistillStep, RuntimeSettings)
    nullable = {f"{c.__name__}.{n}" for c in sections for n, f in c.model_fields.items() if f.default is None}
    # a student depth by layer count (else keep_every), no sliding window, threads from target.threads, all-int4
    assert nullable == {
        "DistillStep.layers",
        "RuntimeSettings.sliding_window",
        "RuntimeSettings.threads",
        "RuntimeSettings.speculative",  # no speculative decoding
        "OnnxGenAIStep.mixed_precision",
    }


def test_a_setting_of_another_quantization_method_is_refused(tmp_path):
    text = (
        "variants:\n  baseline: {}\n  q:\n    steps:\n      - quantize: {method: bnb_int8, group_size: 64}\n"
    )
    with pytest.raises(
        ConfigError, match=r"group_size applies to torchao_int4_weight_only / .* / gptqmodel, not bnb_int8"
    ):
        load_config(write(tmp_path, text))


def test_a_profile_extends_the_default_file_adding_variants_and_changing_keys(tmp_path):
    write(
        tmp_path,
        "evaluate:\n  window: 128\n  max_tokens: 512\nvariants:\n  baseline: {}\n  bf16: {runtime: {dtype: bfloat16}}\n",
    )
    profile = tmp_path / "params.full.yaml"
    profile.write_text(
        "extends: params.yaml\nevaluate:\n  window: 64\nvariants:\n  eager: {runtime: {attention: eager}}\n"
    )
    config = load_config(profile)
    assert (config.evaluate.window, config.evaluate.max_tokens) == (64, 512)
    assert list(config.variants) == ["baseline", "bf16", "eager"]
    profile.write_text("extends: params.yaml\nvariants:\n  bf16: null\n")  # a profile leaves a variant out
    assert list(load_config(profile).variants) == ["baseline"]


def test_repository_document_qa_profile_measures_long_context_and_its_kv_settings():
    config = load_config(REPO / "params.document_qa.yaml")
    assert config.long_context is not None and max(config.long_context.lengths) == 8192
    assert config.long_context.retrieval is not None
    assert config.project.workdir != load_config(REPO / "params.yaml").project.workdir
    settings = {name: v.runtime for name, v in config.variants.items()}
    assert any(s.kv_cache == "quantized" for s in settings.values())
    assert any(s.sliding_window for s in settings.values())
    assert config.benchmark.served_lengths == [1024, 2048, 4096, 8192] and config.slo is not None


def test_repository_full_profile_loads_and_enables_every_step_kind():
    config = load_config(REPO / "params.full.yaml")
    kinds = {step.kind for variant in config.variants.values() for step in variant.steps}
    assert kinds == {"prune", "distill", "quantize", "onnx_genai", "llama_cpp"}
    methods = {s.quantize.method for v in config.variants.values() for s in v.steps if s.quantize}
    gpu_only = {name for name, method in METHODS.items() if "cpu" not in method.devices}
    assert gpu_only == {"gptqmodel", "torchao_fp8_per_row"}
    assert methods == set(METHODS) - gpu_only
    assert config.variants.keys() > load_config(REPO / "params.yaml").variants.keys()


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (
            [{"llama_cpp": {}}, {"prune": {"method": "unstructured"}}],
            "llama_cpp changes the engine and must be",
        ),
        ([{"llama_cpp": {}}, {"onnx_genai": {}}], "each export the model; a variant has one engine"),
        (
            [{"prune": {"method": "unstructured"}}, {"llama_cpp": {"type": "shipped"}}],
            "it takes no other steps",
        ),
        ([{"llama_cpp": {"type": "shipped", "imatrix": True}}], "imatrix and mixed_precision do not apply"),
        (
            [{"llama_cpp": {"type": "shipped", "mixed_precision": {}}}],
            "imatrix and mixed_precision do not apply",
        ),
        (
            [{"llama_cpp": {"type": "Q4_K_M", "mixed_precision": {}}}],
            "mixed_precision applies to type Q4_0 or",
        ),
        ([{"llama_cpp": {"imatrix_windows": 8}}], "imatrix_windows applies only with imatrix: true"),
        ([{"llama_cpp": {"type": "Q3_K"}}], "llama_cpp.type: Input should be 'F32'"),
    ],
)
def test_llama_cpp_steps_that_cannot_work_are_refused(tmp_path, steps, message):
    params = {"variants": {"baseline": {}, "v": {"steps": steps}}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write(tmp_path, yaml.safe_dump(params)))


def test_the_former_spelling_of_the_wrapper_works_keeps_its_hash_and_says_so_once(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("variants:\n  baseline: {}\n  ds:\n    runtime: {engine: deepspeed}\n")
    notices: list[str] = []
    config = load_config(params, notices.append)
    assert config.variants["ds"].runtime.wrapper == "deepspeed"
    assert notices == [
        "params.yaml: variants.ds.runtime: engine: deepspeed → wrapper: deepspeed (the former spelling still works, "
        "for now)"
    ]
    renamed = VariantConfig.model_validate({"runtime": {"wrapper": "deepspeed"}})
    assert renamed.recipe_hash() == config.variants["ds"].recipe_hash() == RECORDED["deepspeed"]["hash"]
    assert RuntimeSettings().identity()["engine"] == "torch"  # build keys and model hashes read it as before


def test_tensorrt_llm_is_refused_in_one_line_where_it_is_written(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("variants:\n  baseline: {}\n  trt:\n    runtime: {engine: tensorrt_llm}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(params, lambda line: None)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "params.yaml: variants.trt.runtime: engine: tensorrt_llm is not built by llmopt"
    )


def test_the_former_name_of_gptqmodel_still_reads_and_is_named_once(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        "target: {device: cuda}\nvariants:\n  baseline: {}\n  g:\n    steps:\n      - quantize: {method: gptq}\n"
    )
    notices: list[str] = []
    config = load_config(params, notices.append)
    assert config.variants["g"].steps[0].settings.method == "gptqmodel"
    assert notices == [
        "params.yaml: variants.g.steps[0].quantize: method: gptq → method: gptqmodel "
        "(the former spelling still works, for now)"
    ]


def test_one_slo_serves_the_load_test_and_the_serving_objective_and_the_old_place_says_where_it_went(
    tmp_path,
):
    text = MINIMAL + "select: {objective: serving}\nslo: {ttft_p95_ms: 2000}\n"
    config = load_config(write(tmp_path, text))
    assert config.slo.ttft_p95_ms == 2000 and config.benchmark.served_clients == [1, 16]
    said: list[str] = []
    former = load_config(write(tmp_path, MINIMAL + "loadtest: {slo: {ttft_p95_ms: 2000}}\n"), said.append)
    assert former.slo.ttft_p95_ms == 2000 and len(said) == 1 and "loadtest.slo → slo" in said[0]
    with pytest.raises(ConfigError, match="set only the top-level slo"):
        load_config(write(tmp_path, text + "loadtest: {slo: {ttft_p95_ms: 1000}}\n"))
    with pytest.raises(ConfigError, match=r"objective: serving .*served_clients must not be empty"):
        load_config(write(tmp_path, text + "benchmark: {served_clients: []}\n"))
    with pytest.raises(ConfigError, match="served_clients must not repeat"):
        load_config(write(tmp_path, MINIMAL + "benchmark: {served_clients: [16, 16]}\n"))
    assert Config.model_validate({"variants": {"baseline": {}}}).benchmark.short().served_clients == []
