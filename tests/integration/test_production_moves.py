"""Production moves on a real MLflow registry (SQLite): the lock, lost races, history, rollback, ghost runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tasks.decide.history import history, move_production, rollback_target
from tasks.decide.model_registry import LOCK_SUFFIX, PRODUCTION, current_version, registry_lock
from tasks.errors import RegistryError
from tasks.report.tracking import mark_ghost_runs, process_tags

MODEL = "moves"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry(tmp_path):
    """A fresh SQLite tracking + registry store with one model and three versions."""
    import mlflow
    from mlflow import MlflowClient

    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    client = MlflowClient()
    client.create_registered_model(MODEL)
    for index in range(3):
        (tmp_path / f"v{index}").mkdir()
        client.create_model_version(
            MODEL, (tmp_path / f"v{index}").as_uri(), tags={"llmopt.content_hash": f"h{index}"}
        )
    yield client
    mlflow.set_tracking_uri(previous[0])
    mlflow.set_registry_uri(previous[1])


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_two_moves_decided_on_the_same_production_leave_one_production_and_two_records(registry):
    move_production(MODEL, "1", None, "setup", "gate", "first promotion", "passed: first")
    barrier = threading.Barrier(2)
    results = {}

    def decide_then_move(version: str) -> None:
        seen = current_version(MODEL, PRODUCTION)  # the check ...
        barrier.wait()  # ... both decided on v1 before either moves
        results[version] = move_production(
            MODEL, version, seen, f"thread {version}", "gate", "faster", "passed"
        )

    threads = [threading.Thread(target=decide_then_move, args=(v,)) for v in ("2", "3")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results.values()) == [False, True]
    winner = next(v for v, moved in results.items() if moved)
    assert current_version(MODEL, PRODUCTION) == winner
    moves = history(MODEL)[1:]
    assert len(moves) == 2 and sorted(m.kind for m in moves) == ["gate", "lost-race"]
    lost = next(m for m in moves if m.kind == "lost-race")
    assert not lost.moved and f"production moved from v1 to v{winner}" in lost.reason
    assert MODEL + LOCK_SUFFIX not in {m.name for m in registry.search_registered_models()}  # released


def test_rollback_returns_to_the_version_before_the_last_move(registry):
    move_production(MODEL, "1", None, "run a", "gate", "first", "passed")
    move_production(MODEL, "2", "1", "run b", "gate", "faster", "passed")
    assert rollback_target(MODEL) == ("2", "1")
    move_production(
        MODEL, "1", "2", "llmopt rollback", "rollback", "v2 misbehaves", "rollback: v2 misbehaves"
    )
    assert current_version(MODEL, PRODUCTION) == "1"
    assert [(m.kind, m.from_version, m.to_version) for m in history(MODEL)] == [
        ("gate", None, "1"),
        ("gate", "1", "2"),
        ("rollback", "2", "1"),
    ]
    assert registry.get_model_version(MODEL, "1").tags["llmopt.gate"] == "rollback: v2 misbehaves"


def test_rollback_without_an_earlier_production_is_a_clear_error(registry):
    move_production(MODEL, "1", None, "run a", "gate", "first", "passed")
    with pytest.raises(RegistryError, match="no earlier production version to roll back to"):
        rollback_target(MODEL)


def test_a_lock_left_by_a_dead_process_is_broken_and_a_live_holder_makes_others_wait(registry):
    tags = {"llmopt.lock.host": socket.gethostname(), "llmopt.lock.pid": str(dead_pid())}
    registry.create_registered_model(MODEL + LOCK_SUFFIX, tags=tags)
    held = pytest.raises(
        RegistryError, match="another production move or registration holds the registry lock"
    )
    with registry_lock(MODEL, "me"), held, registry_lock(MODEL, "someone else", timeout_s=0.5):
        pass


def test_runs_left_running_by_a_dead_process_of_this_host_are_marked_killed(registry):
    experiment = registry.create_experiment("ghosts")
    ghost_tags = {**process_tags(), "llmopt.pid": str(dead_pid())}
    ghost = registry.create_run(experiment, tags=ghost_tags).info.run_id
    alive = registry.create_run(experiment, tags=process_tags()).info.run_id
    elsewhere = registry.create_run(
        experiment, tags={**ghost_tags, "llmopt.host": "another-host"}
    ).info.run_id
    assert mark_ghost_runs(experiment) == [ghost]
    statuses = {run: registry.get_run(run).info.status for run in (ghost, alive, elsewhere)}
    assert statuses == {ghost: "KILLED", alive: "RUNNING", elsewhere: "RUNNING"}


def test_moving_production_where_it_already_is_records_nothing_and_keeps_rollback_working(registry):
    move_production(MODEL, "1", None, "run a", "gate", "first", "passed")
    move_production(MODEL, "2", "1", "run b", "gate", "faster", "passed")
    assert move_production(MODEL, "2", "2", "llmopt promote --force", "forced", "again", "forced: again")
    assert len(history(MODEL)) == 2 and rollback_target(MODEL) == ("2", "1")


def test_a_registry_that_fails_to_answer_under_the_lock_stops_the_move_and_keeps_an_unfinished_one(
    registry, monkeypatch
):
    """Under the lock a move first finishes or undoes one a killed process left; if the registry does not answer
    that read (a 5xx), the move stops there (a retry may get past it) instead of writing its own intent over the
    unfinished one's, which could then never be rolled back."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.decide.history import INTENT_TAG

    registry.set_registered_model_tag(MODEL, INTENT_TAG, '{"unfinished": "from a killed process"}')
    real, failed = MlflowClient.get_registered_model, []

    def unanswered(self, name):
        if name == MODEL and not failed:  # the first read of the model's own tags: the one under the lock
            failed.append(name)
            raise MlflowException("the registry did not answer", error_code="INTERNAL_ERROR")
        return real(self, name)

    monkeypatch.setattr(MlflowClient, "get_registered_model", unanswered)
    with pytest.raises(MlflowException, match="did not answer"):
        move_production(MODEL, "1", None, "run a", "gate", "first", "passed")
    monkeypatch.undo()
    assert registry.get_registered_model(MODEL).tags[INTENT_TAG] == '{"unfinished": "from a killed process"}'
    assert current_version(MODEL, PRODUCTION) is None


MOVE_IN_A_CHILD = """
import sys, mlflow
from tasks.decide.history import move_production
mlflow.set_tracking_uri(sys.argv[1]); mlflow.set_registry_uri(sys.argv[1])
move_production("moves", "2", "1", "llmopt promote", "forced", "a faster build", "forced: a faster build")
"""


@pytest.mark.parametrize(
    ("point", "moved"),
    [("promote-intent", False), ("promote-tags", False), ("promote-alias", True), ("promote-recorded", True)],
)
def test_a_promotion_killed_at_each_step_is_completed_or_rolled_back_by_the_next_command(
    registry, tmp_path, point, moved
):
    """SIGKILL between the steps of a move (intent, version tags, alias, history record): the next command finds
    the intent and completes the move where the alias had moved (one history record, written once) or rolls it back
    where it had not (the version's tags restored, the interruption recorded), and says which."""
    import mlflow

    from tasks.decide.history import INTENT_TAG, recover_unfinished_move

    move_production(MODEL, "1", None, "setup", "gate", "first promotion", "passed: first")
    registry.set_model_version_tag(MODEL, "2", "llmopt.gate", "refused: an older verdict")
    child = subprocess.run(
        [sys.executable, "-c", MOVE_IN_A_CHILD, mlflow.get_registry_uri()],
        env={"LLMOPT_FAILPOINT": point, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -9, child.stderr[-2000:]  # killed at the fail point
    assert INTENT_TAG in registry.get_registered_model(MODEL).tags  # the half-done move is visible

    note = recover_unfinished_move(MODEL, "the next command")
    tags = registry.get_model_version(MODEL, "2").tags
    assert INTENT_TAG not in registry.get_registered_model(MODEL).tags
    moves = history(MODEL)
    if moved:
        assert note.startswith("completed an interrupted move of production to v2")
        assert current_version(MODEL, PRODUCTION) == "2" and tags["llmopt.gate"] == "forced: a faster build"
        assert [(m.kind, m.to_version, m.moved) for m in moves] == [
            ("gate", "1", True),
            ("forced", "2", True),
        ]
        assert rollback_target(MODEL) == ("2", "1")
    else:
        assert note.startswith("rolled back an interrupted move of production to v2")
        assert current_version(MODEL, PRODUCTION) == "1"
        assert tags["llmopt.gate"] == "refused: an older verdict" and "llmopt.previous_production" not in tags
        assert [(m.kind, m.to_version, m.moved) for m in moves] == [
            ("gate", "1", True),
            ("interrupted", "2", False),
        ]
    assert recover_unfinished_move(MODEL, "a later command") is None  # nothing left to do
    assert move_production(MODEL, "3", current_version(MODEL, PRODUCTION), "next", "gate", "faster", "passed")
