"""Runtime settings (attention, KV cache, sliding window, DeepSpeed) on a tiny Llama: they load, generate and do
what they claim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.pytorch.kv_cache import generation_options, kv_cache_bytes
from tasks.inputs.load import PreparedBase
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant

SETTINGS = {
    "baseline": {},
    "eager": {"attention": "eager"},
    "static_kv": {"kv_cache": "static"},
    "kv4": {"kv_cache": "quantized"},
    "kv2": {"kv_cache": "quantized", "kv_cache_bits": 2},
    "window8": {"sliding_window": 8},
    "deepspeed": {"wrapper": "deepspeed"},
    "sdpa_flash": {"attention": "sdpa_flash"},
    "sdpa_math": {"attention": "sdpa_math"},
    "sdpa_efficient": {"attention": "sdpa_efficient"},  # a CUDA kernel: pre-flight refuses it on cpu
}
TEXT = "The river walks the stone near the garden 12. The train finds the book near the quiet forest 7."


@pytest.fixture(scope="module")
def runtimes(tiny_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tiny_base
    root = tmp_path_factory.mktemp("runtime-settings")
    for name, runtime in SETTINGS.items():
        build_variant(name, VariantConfig.model_validate({"runtime": runtime}), base, "d", root / name)
    return {name: load_runtime(root / name, TargetConfig(threads=1)) for name in SETTINGS}


def logits(runtime, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return runtime.model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", ["eager", "static_kv", "deepspeed", "sdpa_flash", "sdpa_math"])
def test_exact_settings_generate_what_the_baseline_generates(runtimes, name):
    ids = runtimes["baseline"].encode(TEXT)
    expected = runtimes["baseline"].generate([ids, ids[:-3]], 10, stop_at_eos=False)
    assert runtimes[name].generate([ids, ids[:-3]], 10, stop_at_eos=False) == expected
    assert torch.allclose(logits(runtimes[name], ids), logits(runtimes["baseline"], ids), atol=1e-5)


def test_quantized_kv_cache_holds_fewer_bytes_than_the_full_precision_cache(runtimes):
    ids = runtimes["baseline"].encode(TEXT * 3)
    sizes = {}
    for name in ("baseline", "kv4", "kv2"):
        model = runtimes[name].model
        options = generation_options(runtimes[name].manifest.runtime_settings(), model.config.head_dim)
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=24,
                do_sample=False,
                return_dict_in_generate=True,
                **options,
            )
        sizes[name] = kv_cache_bytes(out.past_key_values)
    assert sizes["kv2"] < sizes["kv4"] < 0.6 * sizes["baseline"]
    assert len(runtimes["kv4"].generate([ids], 8, stop_at_eos=False)[0]) == 8


def test_a_quantized_kv_cache_is_the_cache_of_sequences_and_of_the_servers_decoder_too(runtimes):
    """So long-context accuracy and served requests measure the cache the recipe names, not a float one."""
    from transformers import QuantizedCache

    ids = runtimes["baseline"].encode(TEXT * 4)
    rows = {}
    for name in ("baseline", "kv2"):
        sequence = runtimes[name].sequence(len(ids))
        sequence.extend(ids[:-8], every=False)
        rows[name] = sequence.extend(ids[-8:], every=True)
        assert isinstance(sequence._cache, QuantizedCache) == (name == "kv2")
        assert sequence.rewinds == (name == "baseline")  # a quantized cache cannot be cropped
    assert rows["kv2"].shape == rows["baseline"].shape
    assert not np.allclose(rows["kv2"], rows["baseline"], atol=1e-4)  # 2-bit keys/values past the residual
    decoder = runtimes["kv2"].batch_decoder()
    sequence, _ = decoder.add(ids[:-8])
    decoder.step({sequence: ids[-8]})
    assert isinstance(decoder._caches[sequence], QuantizedCache)


def test_sliding_window_sees_only_the_last_tokens_and_bounds_the_cache(runtimes):
    ids = runtimes["baseline"].encode(TEXT)
    full, windowed = logits(runtimes["baseline"], ids), logits(runtimes["window8"], ids)
    assert len(ids) > 16
    assert torch.allclose(full[:8], windowed[:8], atol=1e-5)  # inside the window nothing changes
    assert not torch.allclose(full[12:], windowed[12:], atol=1e-3)  # beyond it, older tokens are out of sight
    with torch.no_grad():
        out = runtimes["window8"].model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    assert out.past_key_values.layers[0].keys.shape[-2] < 8 < len(ids)


def test_a_pinned_sdpa_kernel_that_cannot_run_raises_instead_of_falling_back(runtimes):
    """So the kernel a variant records is the kernel that ran (the CPU has no memory-efficient SDPA kernel)."""
    ids = runtimes["baseline"].encode(TEXT)
    with pytest.raises(RuntimeError, match="No viable backend for scaled_dot_product_attention"):
        runtimes["sdpa_efficient"].generate([ids], 2)
    assert runtimes["sdpa_flash"].generate([ids], 2) == runtimes["baseline"].generate([ids], 2)


def test_the_efficient_kernel_gets_repeated_key_value_heads_with_the_same_attention(runtimes, monkeypatch):
    """torch's memory-efficient kernel takes no `enable_gqa` (an H200 run: "No available kernel" for a grouped-query
    Llama): while it is the only kernel enabled, transformers repeats the key/value heads itself (packs them for one
    query), which gives the attention the grouped-query call gives."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations import sdpa_attention

    from tasks.engines.pytorch import runtime as pytorch

    assert runtimes["sdpa_efficient"] is not None  # its runtime installed the rule
    key = torch.zeros(1, 2, 5, 16)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert pytorch.only_efficient_sdpa_enabled()
        assert not sdpa_attention.use_gqa_in_sdpa(None, key, key)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert not pytorch.only_efficient_sdpa_enabled()
        assert sdpa_attention.use_gqa_in_sdpa(None, key, key)

    model, ids = runtimes["baseline"].model, runtimes["baseline"].encode(TEXT)
    assert model.config.num_key_value_heads < model.config.num_attention_heads

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            prefill = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True)
            step = model(input_ids=torch.tensor([ids[-1:]]), past_key_values=prefill.past_key_values)
        return prefill.logits, step.logits

    seen: list[bool] = []
    original = sdpa_attention.torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append(kwargs.get("enable_gqa", False))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", spy)
    grouped = run()
    assert any(seen)  # without the rule transformers asks SDPA for grouped-query attention
    seen.clear()
    monkeypatch.setattr(pytorch, "only_efficient_sdpa_enabled", lambda: True)  # as under the CUDA kernel
    repeated = run()
    assert seen and not any(seen)
    for a, b in zip(grouped, repeated, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny Llama whose heads are 32 wide (llama.cpp quantizes its cache in blocks of 32 values of a head), as
    llama.cpp F32 GGUFs with each cache type."""
    from tasks.local_files import folder_sha256
    from tests.factories import build_tiny_llama, synthetic_sentences

    root = tmp_path_factory.mktemp("wide-heads")
    model = build_tiny_llama(
        root / "hf", synthetic_sentences(200, seed=0), head_dim=32, num_attention_heads=2
    )
    base = PreparedBase(model, folder_sha256(model), "wide")
    runtimes = {}
    for kind in ("f16", "q8_0", "q4_0"):
        recipe = {"steps": [{"llama_cpp": {"type": "F32"}}], "runtime": {"kv_cache_type": kind}}
        build_variant(kind, VariantConfig.model_validate(recipe), base, "d", root / kind)
        runtimes[kind] = load_runtime(root / kind, TargetConfig(threads=1))
    return runtimes


@pytest.mark.parametrize(("kind", "bytes_per_value"), [("q8_0", 34 / 32), ("q4_0", 18 / 32)])
def test_llama_cpp_kv_cache_type_quantizes_its_cache_and_scores_close_to_f16(
    wide_heads, kind, bytes_per_value
):
    ids = [(7 * i + 3) % 200 + 10 for i in range(300)]
    held = {}
    for name in ("f16", kind):
        sequence = wide_heads[name].sequence(512)
        sequence.extend(ids, every=False)
        held[name] = sequence.kv_bytes()
        del sequence
    # the cache's keys and values per token: f16's 2 bytes a value, blocks of 32 values in 34 or 18 bytes (and a
    # few bytes per cell of positions, which weigh on a model this small: ~6 % of q4_0's 144 bytes a token)
    assert bytes_per_value / 2 <= held[kind] / held["f16"] <= bytes_per_value / 2 * 1.1
    (plain, count), (quantized, _) = wide_heads["f16"].score([ids])[0], wide_heads[kind].score([ids])[0]
    assert quantized != plain and quantized / count == pytest.approx(plain / count, rel=0.05)


def test_a_cache_type_the_models_heads_cannot_take_is_named_by_llama_cpp(tiny_engine_dir, tmp_path):
    import json
    import shutil

    from tasks.errors import EngineError

    folder = tmp_path / "q8_0"  # the tiny model's heads are 16 wide: not a block of 32
    shutil.copytree(tiny_engine_dir("llama.cpp"), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["recipe"]["runtime"] = {"kv_cache_type": "q8_0"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="block size 32 does not divide n_embd_head_k=16"):
        load_runtime(folder, TargetConfig(threads=1)).score([[5, 6, 7]])
    with pytest.raises(ValueError, match="kv_cache_type is llama.cpp's KV cache type"):
        VariantConfig.model_validate({"runtime": {"kv_cache_type": "q8_0"}})
