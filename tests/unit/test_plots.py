from tasks.config import SelectConfig
from tasks.plots import tradeoff_plot
from tasks.select import build_leaderboard
from tests.unit.test_select import score


def test_tradeoff_plot_writes_a_png_with_every_variant(tmp_path):
    board = build_leaderboard(
        [score("baseline", 1.0, 10), score("fast", 1.02, 40), score("bad", 1.5, 90)], SelectConfig()
    )
    path = tradeoff_plot(board, tmp_path / "tradeoff.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
