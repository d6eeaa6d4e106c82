"""The llama.cpp engine on the tiny model: GGUF conversion is faithful (F32 scores like PyTorch fp32), greedy decoding
matches PyTorch, every llama.cpp file type llmopt offers loads and runs, and the importance matrix reaches the
quantizer. (Batching and the rest of the Runtime contract: test_engine_contract.py; serving: test_serving_app.py.)"""

from __future__ import annotations

import math

import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.llama_cpp.runtime import MODEL_FILE
from tasks.inputs.load import PreparedBase
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.factories import synthetic_sentences

TEXT = " ".join(synthetic_sentences(40, seed=3))


def _build(name: str, step: dict, tiny_base: PreparedBase, folder, calibration=None):
    recipe = VariantConfig.model_validate({"steps": [{"llama_cpp": step}]})
    return build_variant(name, recipe, tiny_base, "d", folder / name, calibration=calibration)


@pytest.fixture(scope="module")
def gguf_dir(tiny_base, tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize(("file_type", "tolerance"), [("F32", 1e-3), ("F16", 1e-2)])
def test_gguf_scores_like_pytorch_fp32(file_type, tolerance, tiny_base, gguf_dir, baseline_runtime):
    manifest = _build(file_type, {"type": file_type}, tiny_base, gguf_dir)
    assert manifest.engine == "llama.cpp" and manifest.weights_format == "gguf"
    runtime = load_runtime(gguf_dir / file_type, TargetConfig(threads=1))
    ids = baseline_runtime.encode(TEXT)
    windows = [ids[i : i + 64] for i in range(0, len(ids) - 64, 64)]
    assert len(windows) >= 4
    torch_scores, gguf_scores = baseline_runtime.score(windows), runtime.score(windows)
    assert [n for _, n in gguf_scores] == [n for _, n in torch_scores]
    tokens = sum(n for _, n in torch_scores)
    torch_ppl = math.exp(sum(nll for nll, _ in torch_scores) / tokens)
    gguf_ppl = math.exp(sum(nll for nll, _ in gguf_scores) / tokens)
    print(f"{file_type}: perplexity {gguf_ppl:.6f} vs PyTorch fp32 {torch_ppl:.6f}")
    assert gguf_ppl == pytest.approx(torch_ppl, rel=tolerance)
    # a random model is near-uniform, so perplexity alone barely tells models apart: compare the logits too,
    # against their own spread (a wrong tensor or a mis-permuted q/k moves them by about that spread)
    torch_step, gguf_step = baseline_runtime.batch_decoder(), runtime.batch_decoder()
    for prompt in windows[:3]:
        expected, got = torch_step.add(prompt)[1], gguf_step.add(prompt)[1]
        assert abs(got - expected).max() < 10 * tolerance * expected.std()
    assert runtime.context_length == baseline_runtime.context_length


def test_greedy_generation_matches_pytorch(tiny_base, gguf_dir, baseline_runtime):
    _build("F32", {"type": "F32"}, tiny_base, gguf_dir)
    runtime = load_runtime(gguf_dir / "F32", TargetConfig(threads=1))
    ids = baseline_runtime.encode(TEXT)
    prompts = [ids[:5], ids[10:22], ids[30:61]]
    expected = baseline_runtime.generate(prompts, 12, stop_at_eos=False)
    assert runtime.generate(prompts, 12, stop_at_eos=False) == expected


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0", "Q4_K_M"])
def test_every_quantized_type_builds_loads_and_scores_every_token(
    file_type, tiny_base, gguf_dir, baseline_runtime
):
    """(How far each type moves the model, and that it stores that type: test_techniques.py, on a trained model.)"""
    manifest = _build(file_type, {"type": file_type}, tiny_base, gguf_dir)
    assert _architecture(gguf_dir / file_type / MODEL_FILE) == "llama"
    runtime = load_runtime(gguf_dir / file_type, TargetConfig(threads=1))
    ids = baseline_runtime.encode(TEXT)[:128]
    (quantized,), (fp32,) = runtime.score([ids]), baseline_runtime.score([ids])
    assert quantized[1] == fp32[1] and math.isfinite(quantized[0])
    assert manifest.size_bytes < (gguf_dir / "F32" / MODEL_FILE).stat().st_size or file_type == "Q8_0"


def test_the_importance_matrix_covers_every_matrix_and_changes_the_rounding(tiny_base, gguf_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.engines.llama_cpp.gguf import gguf_tensor_name, importance_matrix

    model = AutoModelForCausalLM.from_pretrained(tiny_base.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base.path)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    matrix = importance_matrix(model, [ids[:64], ids[64:128]])
    layers = model.config.num_hidden_layers
    assert len(matrix) == 7 * layers  # q, k, v, o, gate, up, down; the tied lm_head reuses the embedding
    assert len(matrix["blk.1.ffn_down.weight"]) == model.config.intermediate_size
    assert all(value >= 0 for values in matrix.values() for value in values)
    assert gguf_tensor_name("model.layers.0.self_attn.q_proj", model) == "blk.0.attn_q.weight"

    from gguf import GGUFReader

    _build("Q4_0", {"type": "Q4_0"}, tiny_base, gguf_dir)
    calibration = synthetic_sentences(60, seed=9)
    _build("Q4_0i", {"type": "Q4_0", "imatrix": True, "imatrix_windows": 2}, tiny_base, gguf_dir, calibration)
    tensors = {t.name for t in GGUFReader(str(gguf_dir / "Q4_0i" / MODEL_FILE)).tensors}
    assert set(matrix) <= tensors  # the names the quantizer looks importance data up by
    plain = (gguf_dir / "Q4_0" / MODEL_FILE).read_bytes()
    weighted = (gguf_dir / "Q4_0i" / MODEL_FILE).read_bytes()
    assert len(plain) == len(weighted) and plain != weighted  # same layout, other rounding


def test_a_shipped_gguf_is_the_peer_row_and_copied_unchanged(tiny_base, gguf_dir, tmp_path):
    import shutil

    _build("F16", {"type": "F16"}, tiny_base, gguf_dir)
    source = tmp_path / "source"
    shutil.copytree(tiny_base.path, source)
    shutil.copyfile(gguf_dir / "F16" / MODEL_FILE, source / "tiny.F16.gguf")
    base = PreparedBase(tiny_base.path, tiny_base.content_hash, str(source))
    recipe = VariantConfig.model_validate({"steps": [{"llama_cpp": {"type": "shipped"}}]})
    assert recipe.peer
    build_variant("peer", recipe, base, "d", tmp_path / "peer")
    assert (tmp_path / "peer" / MODEL_FILE).read_bytes() == (source / "tiny.F16.gguf").read_bytes()
    assert load_runtime(tmp_path / "peer", TargetConfig(threads=1)).score([[5, 6, 7]])[0][1] == 2


def _architecture(path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def test_every_llama_cpp_computation_runs_on_one_thread_whoever_calls(tiny_engine_dir, monkeypatch):
    """llama.cpp's CPU backend keeps a team of OpenMP workers per calling thread; once two threads had computed,
    the second's steps took ~2.8x as long (the server's worker after a warm-up on the main thread). So generation
    on this thread and a batch decoder's steps on another both run on the engine's one compute thread."""
    import threading

    from tasks.engines.llama_cpp.runtime import llama_cpp_module

    runtime = load_runtime(tiny_engine_dir("llama.cpp"), TargetConfig(threads=1))
    lib, threads = llama_cpp_module(), []
    decode = lib.llama_decode

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return decode(*args)

    monkeypatch.setattr(lib, "llama_decode", recorded)
    prompt = runtime.encode("The river walks the stone")
    runtime.generate([prompt], 3, stop_at_eos=False)

    def steps() -> None:
        decoder = runtime.batch_decoder()
        sequence, logits = decoder.add(prompt)
        decoder.step({sequence: int(logits.argmax())})
        decoder.remove(sequence)

    worker = threading.Thread(target=steps, name="scheduler-like")
    worker.start()
    worker.join(timeout=60)
    assert len(threads) >= 5 and len(set(threads)) == 1 and threads[0].startswith("llmopt-llama.cpp")


def test_a_step_puts_its_rows_into_llama_cpps_batch_by_stream_and_hands_each_its_own_logits(
    tiny_engine_dir, monkeypatch
):
    """With a stream per sequence, llama.cpp computes in one pass only sequences whose ids follow each other in
    the batch; rows in the order requests came (their streams scrambled as requests leave and join) made it read
    every weight once per row. The rows go in by stream, and each sequence still gets its own logits."""
    import numpy as np

    from tasks.engines.llama_cpp.runtime import llama_cpp_module

    runtime = load_runtime(tiny_engine_dir("llama.cpp"), TargetConfig(threads=1))
    prompts = [runtime.encode(text) for text in synthetic_sentences(5, seed=11)]

    def alone(prompt: list[int]) -> tuple[int, np.ndarray]:
        decoder = runtime.batch_decoder()
        sequence, logits = decoder.add(prompt)
        token = int(logits.argmax())
        return token, decoder.step({sequence: token})[sequence]

    expected = [alone(prompt) for prompt in prompts]
    lib, batches = llama_cpp_module(), []
    decode = lib.llama_decode

    def recorded(context, batch):
        batches.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return decode(context, batch)

    decoder = runtime.batch_decoder()
    decoder.rows = 4
    sequences = [decoder.add(prompt)[0] for prompt in prompts[:4]]
    decoder.remove(sequences.pop(1))  # its stream (the second) goes to the next newcomer
    sequences.append(decoder.add(prompts[4])[0])
    held = [0, 2, 3, 4]  # the prompts the running sequences hold, in order of arrival
    assert [decoder._slots[s] for s in sequences] == [0, 2, 3, 1]  # not in stream order
    monkeypatch.setattr(lib, "llama_decode", recorded)
    stepped = decoder.step({s: expected[p][0] for s, p in zip(sequences, held, strict=True)})
    assert batches == [[0, 1, 2, 3]]  # one pass: streams 0, 1, 2, 3 in a row
    for sequence, prompt in zip(sequences, held, strict=True):
        np.testing.assert_allclose(stepped[sequence], expected[prompt][1], rtol=0, atol=1e-4)


def test_batched_generation_gives_each_row_a_kv_stream_and_the_answers_of_each_row_alone(tiny_engine_dir):
    """In one KV cache every row's attention spans every row's cells; batched generation gives each row a stream
    of its own (8 rows of 128 + 64 tokens stepped in 30-33 ms instead of 45-48 here), one alone keeps one cache,
    and scoring after it gets a plain cache again."""
    runtime = load_runtime(tiny_engine_dir("llama.cpp"), TargetConfig(threads=1))
    prompts = [runtime.encode(text) for text in synthetic_sentences(3, seed=5)]
    prompts = [prompt[:6] for prompt in prompts]
    alone = [runtime.generate([prompt], 5, stop_at_eos=False)[0] for prompt in prompts]
    assert runtime._context.unified and runtime._context.sequences == 1
    assert runtime.generate(prompts, 5, stop_at_eos=False) == alone
    made = runtime._context
    assert not made.unified and made.sequences == 3 and made.cells // 3 >= 11
    assert runtime.generate(prompts[:2], 5, stop_at_eos=False) == alone[:2]
    assert runtime._context is made  # a context with room for the batch is kept
    runtime.score([prompts[0] + alone[0]])
    assert runtime._context.unified
