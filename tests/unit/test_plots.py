from dataclasses import replace

import pytest

from tasks.config import SelectConfig
from tasks.decide.select import build_leaderboard
from tasks.report.plots import precision_plot, speed_plot, tradeoff_plot
from tests.unit.test_select import score


def test_tradeoff_plot_writes_a_png_with_every_variant(tmp_path):
    board = build_leaderboard(
        [score("baseline", 1.0, 10), score("fast", 1.02, 40), score("bad", 1.5, 90)], SelectConfig()
    )
    path = tradeoff_plot(board, tmp_path / "tradeoff.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_speed_plot_draws_batches_and_prompt_lengths(tmp_path):
    fast = replace(
        score("fast", 1.02, 40),
        batch_decode_tok_s=((1, 40.0), (4, 120.0), (8, 200.0)),
        ttft_ms_by_prompt=((32, 20.0), (128, 60.0)),
    )
    board = build_leaderboard([replace(fast, variant="baseline"), fast], SelectConfig())
    path = speed_plot(board, tmp_path / "speed.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 20_000


@pytest.mark.parametrize(
    "nodes",
    [
        [f"/model/layers.{i}/{p}/MatMul" for i in range(2) for p in ("attn/qkv_proj", "attn/o_proj")]
        + ["/lm_head/MatMul"],
        [f"blk.{i}.{p}.weight" for i in range(2) for p in ("attn_q", "attn_k", "ffn_down")],  # llama.cpp's
    ],
)
def test_precision_plot_draws_every_matrix_of_a_mixed_precision_plan(tmp_path, nodes):
    matrices = [
        {"node": node, "bits": 8 if i == 1 else 4, "int4_cost": 0.01 * (i + 1), "int8_cost": 1e-5}
        for i, node in enumerate(nodes)
    ]
    plan = {
        "matrices": matrices,
        "stopped_by": "target met",
        "measured_ppl_increase": 0.015,
        "int4_ppl_increase": 0.3,
        "target_ppl_increase": 0.02,
        "size_ratio": 0.58,
    }
    path = precision_plot(plan, tmp_path / "mixed_precision.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
