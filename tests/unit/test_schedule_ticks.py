"""One pipeline run at a time: of the ticks that waited while a run was going, only the newest runs."""

from datetime import UTC, datetime, timedelta

from flows.schedule import superseded_by

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_a_stale_tick_is_superseded_by_the_newest_due_one():
    waiting = [
        ("b", NOW - timedelta(minutes=2)),
        ("c", NOW - timedelta(minutes=1)),
        ("d", NOW + timedelta(minutes=1)),
    ]
    assert superseded_by(NOW - timedelta(minutes=3), waiting, NOW) == "c"  # d is not due yet


def test_the_newest_due_tick_and_runs_by_hand_run():
    waiting = [("a", NOW - timedelta(minutes=3)), ("d", NOW + timedelta(minutes=1))]
    assert superseded_by(NOW - timedelta(minutes=1), waiting, NOW) is None
    assert superseded_by(None, waiting, NOW) is None
