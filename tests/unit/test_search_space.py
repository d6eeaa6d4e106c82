"""The recipe search's space (tasks/search/space.py): every combination of a technique's choices is a candidate
validated as a `variants:` entry; mistakes are ConfigErrors naming the key as params.yaml's do; a candidate written
out as a `variants:` block reads back through `load_config` as the same recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.errors import ConfigError
from tasks.params_file import load_config
from tasks.search.space import expand, variant_block

SPACE = {
    "onnx_genai": {"precision": ["int4", "int8"], "block_size": [32, 64, 128]},
    "llama_cpp": {"type": ["Q4_0", "Q8_0"], "imatrix": [False, True]},
}


def test_every_combination_of_each_techniques_choices_is_a_candidate():
    space = expand(SPACE)
    assert len(space.candidates) == 2 * 3 + 2 * 2 and not space.refused
    names = [candidate.name for candidate in space.candidates]
    assert len(set(names)) == len(names)
    assert "onnx_genai-int4-block_size64" in names and "llama_cpp-q8_0-imatrix" in names
    first = space.candidates[0]
    assert first.variant.steps[0].kind == "onnx_genai" and first.variant.steps[0].settings.block_size == 32


@pytest.mark.parametrize(
    ("space", "named"),
    [
        (
            {"onnx_genai": {"blocksize": [32]}},
            "search.space.onnx_genai.blocksize: not a setting of onnx_genai (did you mean 'block_size'?)",
        ),
        (
            {"onnx": {"precision": ["int4"]}},
            "search.space.onnx: not a technique (did you mean 'onnx_genai'?)",
        ),
        ({"onnx_genai": {"precision": ["int4", "int3"]}}, "search.space.onnx_genai.precision:"),
        ({"onnx_genai": {"block_size": []}}, "search.space.onnx_genai.block_size: a list of choices"),
        ({"onnx_genai": {"block_size": 32}}, "search.space.onnx_genai.block_size: a list of choices"),
        ({}, "search.space: a mapping"),
    ],
)
def test_a_mistake_in_the_space_names_its_key(space, named):
    with pytest.raises(ConfigError) as caught:
        expand(space)
    assert named in str(caught.value)
    assert "int3" in str(caught.value) or "int3" not in str(space)


def test_a_candidate_written_out_reads_back_as_the_same_recipe(tmp_path: Path):
    """The block goes under `variants:` of the project's own params.yaml and `load_config` reads it back: the same
    recipe (hash) as the candidate the search measured."""
    candidate = expand(SPACE).candidates[4]
    params = yaml.safe_load((Path(__file__).parents[2] / "params.yaml").read_text())
    params["variants"] = {"baseline": {}}
    text = yaml.safe_dump(params, sort_keys=False).replace(
        "variants:\n  baseline: {}\n", "variants:\n  baseline: {}\n" + variant_block(candidate)
    )
    (tmp_path / "params.yaml").write_text(text)
    config = load_config(tmp_path / "params.yaml")
    assert config.variants[candidate.name].recipe_hash() == candidate.variant.recipe_hash()
