"""Where log records go. The console shows llmopt's own lines (progress, trials, decisions) and other libraries'
errors; a log file per command keeps everything, Prefect's engine and MLflow's chatter included, with
tracebacks. So the last line a user reads is llmopt's verdict or its error, not an orchestrator's echo of it.
`--debug` leaves every handler as the libraries configured it (everything on the console)."""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import datetime
from pathlib import Path

LOG_ENV = "LLMOPT_LOG_FILE"  # spawned processes (the benchmark) send their own output to the same file
KEEP_LOGS = 20  # newest log files kept per command


class ConsoleFilter(logging.Filter):
    """Pass llmopt's own records (by the file that logged them) and other libraries' errors; an error record
    about an LlmoptError is the orchestrator repeating what llmopt prints itself as its last line."""

    def __init__(self, own_folders: tuple[str, ...]) -> None:
        super().__init__()
        self.own_folders = own_folders

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            getattr(record, "console", True) is False
        ):  # for the log (and Prefect's UI): the CLI prints it itself
            return False
        if record.pathname.startswith(self.own_folders):
            return True
        from tasks.errors import LlmoptError

        if record.levelno < logging.ERROR or record.name.startswith("prefect"):
            return False
        return not (record.exc_info and isinstance(record.exc_info[1], LlmoptError))


class ConsoleFormatter(logging.Formatter):
    """A console line is the message (beside the run's progress lines), with its level when it is a warning or
    worse; tracebacks stay in the log file."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:  # the cause, in one line
            message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


def route_logs(workdir: Path, command: str) -> Path:
    """Everything to `workdir/logs/<command>-<time>.log`, the console filtered (see ConsoleFilter); returns the
    file. Prefect and MLflow are imported first: they install their handlers on import."""
    import prefect.main  # noqa: F401
    from prefect.logging.formatters import PrefectFormatter

    import tasks
    from tasks.report.tracking import import_mlflow

    import_mlflow()

    folder = workdir / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    for old in sorted(folder.glob(f"{command}-*.log"))[:-KEEP_LOGS]:  # names sort by time
        with contextlib.suppress(OSError):  # another command may be pruning the same folder
            old.unlink()
    path = folder / f"{command}-{datetime.now():%Y%m%d-%H%M%S}.log"
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(
        PrefectFormatter(
            format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
            flow_run_fmt="%(asctime)s | %(levelname)-7s | flow run %(flow_run_name)r - %(message)s",
            task_run_fmt="%(asctime)s | %(levelname)-7s | task run %(task_run_name)r - %(message)s",
        )
    )
    # llmopt's packages sit side by side; `serving` is not imported here (it is no pipeline stage's dependency)
    code = Path(tasks.__file__).parent.parent
    own = tuple(f"{code / package}{os.sep}" for package in ("tasks", "flows", "serving"))
    console_filter = ConsoleFilter(own)
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.addFilter(console_filter)
                handler.setFormatter(ConsoleFormatter())  # the file has the times, the levels, the task runs
        if logger is logging.getLogger() or not logger.propagate:
            logger.addHandler(file_handler)
    os.environ[LOG_ENV] = str(path)
    return path
