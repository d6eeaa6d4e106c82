"""A GGUF or ONNX file that parses wrong though its bytes match the hash its manifest recorded (an export cut short
and hashed as written, a broken shipped file): the integrity check cannot tell, so the first load must. It is one
ArtifactError naming the file, in the engine's own words, from the loader the pipeline uses and from the server's
batch decoder alike."""

from __future__ import annotations

import re
import shutil

import pytest

from tasks.config import TargetConfig
from tasks.engines import load_runtime
from tasks.engines.manifest import verify_variant
from tasks.errors import ArtifactError
from tests.factories import damage_as_hashed

# (engine, file cut short, what the engine says about it)
DAMAGES = [
    ("llama.cpp", "model.gguf", r"llama\.cpp cannot load this GGUF file: .*not within the file bounds"),
    ("onnxruntime-genai", "model.onnx", r"ONNX Runtime cannot load this model: .*Protobuf parsing failed"),
    (
        "onnxruntime-genai",
        "model.onnx.data",
        r"ONNX Runtime cannot load this model: External initializer: .* out of bounds",
    ),
]


@pytest.mark.parametrize(("engine", "name", "says"), DAMAGES, ids=[f"{e}-{n}" for e, n, _ in DAMAGES])
def test_a_file_that_parses_wrong_though_its_hash_matches_is_named_in_the_engines_words(
    engine, name, says, tiny_engine_dir, tmp_path
):
    folder = shutil.copytree(tiny_engine_dir(engine), tmp_path / "variant")
    damaged = damage_as_hashed(folder, name)
    verify_variant(folder)  # the bytes are those the manifest recorded: only the engine can tell
    with pytest.raises(ArtifactError) as refused:
        load_runtime(folder, TargetConfig(threads=1))
    message = str(refused.value)
    assert str(folder) in message and "\n" not in message, message
    assert re.search(says, message), message
    if name == "model.gguf":
        assert str(damaged) in message  # llama.cpp is handed the file itself


def test_the_servers_onnx_decoder_refuses_a_graph_damaged_after_the_model_loaded(tiny_engine_dir, tmp_path):
    folder = shutil.copytree(tiny_engine_dir("onnxruntime-genai"), tmp_path / "variant")
    runtime = load_runtime(folder, TargetConfig(threads=1))
    damaged = damage_as_hashed(folder, "model.onnx")
    with pytest.raises(ArtifactError, match=r"model\.onnx: ONNX Runtime cannot load this model: ") as refused:
        runtime.batch_decoder()
    assert str(damaged) in str(refused.value) and "\n" not in str(refused.value)


def test_a_gguf_with_a_wrong_magic_is_refused_with_llama_cpps_own_words(tiny_engine_dir, tmp_path):
    folder = shutil.copytree(tiny_engine_dir("llama.cpp"), tmp_path / "variant")
    path = folder / "model.gguf"
    path.write_bytes(b"XXXX" + path.read_bytes()[4:])
    damage_as_hashed(folder, "model.gguf", keep=1.0)  # nothing cut: the new bytes recorded as the manifest's
    with pytest.raises(ArtifactError, match=r"invalid magic characters: 'XXXX', expected 'GGUF'"):
        load_runtime(folder, TargetConfig(threads=1))
