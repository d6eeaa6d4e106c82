"""The ONNX decoder runs long prompt slices with float activations where the graph rounds them to int8 (its
MatMulNBits at accuracy level 4), and steps and short slices as the graph says (tasks/engines/onnx/runtime.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.onnx.runtime import FLOAT_PROMPT_TOKENS, OrtBatchDecoder, _int8_activations
from tasks.inputs.load import PreparedBase
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant

INT4 = {"steps": [{"onnx_genai": {"precision": "int4", "block_size": 32}}]}  # accuracy level 4: the default


@pytest.fixture(scope="module")
def int4_runtime(trained_base: PreparedBase, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("onnx-int4") / "onnx_int4"
    build_variant("onnx_int4", VariantConfig.model_validate(INT4), trained_base, "d", folder)
    return load_runtime(folder, TargetConfig(threads=1))


def sessions_used(decoder: OrtBatchDecoder) -> list[str]:
    """Which session each call of `decoder` runs on, in order ("float" or "graph")."""
    calls: list[str] = []
    for name, session in (("float", decoder._prompt_session), ("graph", decoder._session)):

        class Spy:
            def __init__(self, inner, label=name):
                self._inner, self._label = inner, label

            def run(self, *args, **kwargs):
                calls.append(self._label)
                return self._inner.run(*args, **kwargs)

            def run_with_iobinding(self, *args, **kwargs):
                calls.append(self._label)
                return self._inner.run_with_iobinding(*args, **kwargs)

            def __getattr__(self, attribute):
                return getattr(self._inner, attribute)

        if name == "float":
            decoder._prompt_session = Spy(session)
        else:
            decoder._session = Spy(session)
    return calls


def test_long_slices_run_with_float_activations_steps_and_short_slices_as_the_graph_says(int4_runtime):
    import onnx

    decoder = int4_runtime.batch_decoder()
    model = Path(int4_runtime._folder) / "model.onnx"
    assert _int8_activations(onnx.load(model, load_external_data=False))
    assert decoder._prompt_session is not decoder._session  # a second session, float activations
    option = "mlas.qnbit.force_fp32"
    assert decoder._prompt_session.get_session_options().get_session_config_entry(option) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # the graph's own: as built
        decoder._session.get_session_options().get_session_config_entry(option)
    calls = sessions_used(decoder)
    prompt = [(7 * index) % 200 + 3 for index in range(FLOAT_PROMPT_TOKENS + 9)]
    sequence, _ = decoder.add(prompt)  # one slice of more than FLOAT_PROMPT_TOKENS tokens
    short, _ = decoder.add(prompt[: FLOAT_PROMPT_TOKENS - 1])
    decoder.step({sequence: 5, short: 6})
    assert calls == ["float", "graph", "graph"]


def test_a_float_prompt_gives_the_graphs_logits_to_int8_rounding_and_the_same_answer(int4_runtime):
    """The two paths differ only in how activations are rounded: the float one's last-position logits stay within
    a few hundredths of the logits' spread of the graph's own, and greedy decoding after either prompt agrees."""
    prompt = [(11 * index) % 250 + 3 for index in range(3 * FLOAT_PROMPT_TOKENS)]
    float_path = int4_runtime.batch_decoder()
    graph_path = int4_runtime.batch_decoder()
    graph_path._prompt_session = graph_path._session  # this one runs the prompt as the graph says
    answers = []
    for decoder in (float_path, graph_path):
        sequence, logits = decoder.add(prompt)
        tokens = [int(np.argmax(logits))]
        for _ in range(12):
            tokens.append(int(np.argmax(decoder.step({sequence: tokens[-1]})[sequence])))
        answers.append((logits, tokens))
    (float_logits, float_tokens), (graph_logits, graph_tokens) = answers
    spread = float(graph_logits.max() - graph_logits.min())
    differ = float(np.abs(float_logits - graph_logits).max())
    # measured 0.6 % here (AVX-512 VNNI); a CPU without MLAS's int8 kernels would compute both alike (0)
    assert differ <= 0.05 * spread, (differ, spread)
    assert float_tokens == graph_tokens


def test_a_graph_with_float_activations_keeps_one_session(tiny_engine_dir):
    """The fp32 export has no MatMulNBits: nothing to run differently, no second copy of the weights."""
    decoder = load_runtime(tiny_engine_dir("onnxruntime-genai"), TargetConfig(threads=1)).batch_decoder()
    assert decoder._prompt_session is decoder._session
