"""The run's one progress display: off a terminal, one plain line per finished piece of work with the stage's
count and ETA; the stage bars of the tasks become rows of that display while it is open."""

from __future__ import annotations

import re

import pytest

from flows import progress as progress_module
from flows.progress import clock, progress_bar, run_progress


def test_plain_lines_count_each_stage_and_give_its_eta_from_the_finished_work(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    lines: list[str] = []
    with run_progress({"build": 3, "evaluate": 3, "benchmark": 0}, line=lines.append) as display:
        for name, seconds in (("baseline", 10), ("onnx_int8", 30)):
            with progress_bar("build", name) as update:
                update(1, 2)
                now[0] += seconds
        with progress_bar("evaluate", "baseline"):
            now[0] += 5
        display.expect("benchmark", 6)
        with pytest.raises(RuntimeError), progress_bar("build", "broken"):
            raise RuntimeError("a failed build is not finished work")
    assert lines == [
        "[ 0:10] build baseline: 10 s (build 1/3, ETA 0:20, evaluate 0/3, benchmark 0/0)",
        "[ 0:40] build onnx_int8: 30 s (build 2/3, ETA 0:20, evaluate 0/3, benchmark 0/0)",
        "[ 0:45] evaluate baseline: 5 s (evaluate 1/3, ETA 0:10, build 2/3, benchmark 0/0)",
    ]
    assert display.summary() == "build 2/3  evaluate 1/3  benchmark 0/6  build ETA 0:20  evaluate ETA 0:10"
    assert progress_module._ACTIVE is None  # closed with the block: stage bars stand alone again


def test_a_stage_bar_outside_a_run_stands_alone_and_clocks_read_as_durations():
    with progress_bar(
        "build", "x"
    ) as update:  # no display open, not a terminal: draws nothing, fails nothing
        update(3, 4)
    assert [clock(s) for s in (0, 59.6, 61, 3600 + 62)] == ["0:00", "1:00", "1:01", "1:01:02"]
    assert re.fullmatch(r"\d+:\d\d", clock(125))


def test_console_lines_are_the_message_and_warnings_say_so():
    import logging

    from flows.logs import ConsoleFormatter

    def line(level: int, message: str) -> str:
        record = logging.LogRecord("prefect.task_runs", level, __file__, 1, message, (), None)
        return ConsoleFormatter().format(record)

    assert line(logging.INFO, "baseline: evaluation unchanged since the last run, reused") == (
        "baseline: evaluation unchanged since the last run, reused"
    )
    assert line(logging.WARNING, "slow disk") == "warning: slow disk"
    assert line(logging.ERROR, "it broke") == "error: it broke"


def test_a_console_error_line_names_its_exception():
    import logging

    from flows.logs import ConsoleFormatter

    try:
        raise OSError("disk full")
    except OSError:
        import sys

        record = logging.LogRecord(
            "distributed", logging.ERROR, __file__, 1, "worker died", (), sys.exc_info()
        )
    assert ConsoleFormatter().format(record) == "error: worker died (OSError: disk full)"


def test_a_record_marked_for_elsewhere_stays_off_the_console_and_llmopts_own_lines_pass():
    """The run's outcome is logged (for the log file and Prefect's UI) and printed by the command as its last
    line: the console shows it once."""
    import logging
    from pathlib import Path

    import flows
    from flows.logs import ConsoleFilter
    from flows.pipeline import CONSOLE_ELSEWHERE

    own = str(Path(flows.__file__).parent) + "/"
    console = ConsoleFilter((own,))

    def record(**extra) -> logging.LogRecord:
        made = logging.LogRecord(
            "prefect.flow_runs", logging.INFO, own + "pipeline.py", 1, "production → v1", (), None
        )
        made.__dict__.update(extra)
        return made

    assert console.filter(record()) and not console.filter(record(**CONSOLE_ELSEWHERE))
