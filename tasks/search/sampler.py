"""Which of the space's candidates a search builds and proxies, in what order (`search.sampler`):

- `grid`: every candidate, in the space's order, up to the room `search.max_candidates` leaves;
- `tpe`: Optuna's TPE sampler, multi-objective (KL to the baseline down, the proxies' decode speed up), proposes
  each next candidate from the proxies of those seen so far: its first `startup` proposals are drawn at random
  (seeded), then it favours the settings of the candidates that were close and fast. A technique is the first
  choice, its settings are conditional on it. A combination the technique refuses, or one proposed before, is not
  built again; after `patience` such proposals in a row the first untried candidate in the space's order is taken,
  so a small space is never left half-seen while room remains;
- `auto` (the default): grid where it sees the whole space (it fits the room and no `budget_minutes` may cut it
  short), else tpe.

The sampler is seeded and deterministic given the proxies it is told, so a resumed search (its proxies handed
back by the journal) proposes the same candidates in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

from tasks.search.proxies import Proxy
from tasks.search.space import Candidate

Sampler = Literal["auto", "grid", "tpe"]


def choose_sampler(sampler: Sampler, candidates: int, room: int, budget_minutes: float | None) -> str:
    """The sampler a search uses: `auto` is grid when the grid sees every candidate, else tpe."""
    if sampler != "auto":
        return sampler
    return "grid" if candidates <= room and budget_minutes is None else "tpe"


def explore(
    candidates: list[Candidate],
    sampler: str,
    room: int,
    build: Callable[[Candidate], bool],
    proxy: Callable[[str], Proxy],
    stop: Callable[[], bool],
    seed: int = 0,
    startup: int = 8,
    patience: int = 20,
) -> list[str]:
    """Build and proxy candidates as `sampler` proposes them, until `room` are built, the space is spent or `stop()`
    says the budget is; `build` returns False for a build that failed (told to the sampler as such). The names
    built, in the order they were proposed."""
    proposals = _grid(candidates) if sampler == "grid" else _tpe(candidates, seed, startup, patience)
    built: list[str] = []
    told: Any = None
    while len(built) < room and not stop():
        try:
            candidate = proposals.send(told)
        except StopIteration:
            break
        told = proxy(candidate.name) if build(candidate) else None
        if told is not None:
            built.append(candidate.name)
    proposals.close()
    return built


def _grid(candidates: list[Candidate]) -> Iterator[Candidate]:
    for candidate in candidates:  # noqa: UP028 (yield from a list cannot be sent the proxies)
        yield candidate


def _tpe(candidates: list[Candidate], seed: int, startup: int, patience: int) -> Iterator[Candidate]:
    """Proposes candidates; is sent each one's proxy (None: its build failed)."""
    import warnings

    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():  # multivariate and group are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=startup, multivariate=True, group=True
        )
    study = optuna.create_study(directions=["minimize", "maximize"], sampler=sampler)
    by_choices = {(c.technique, _key(c.choices)): c for c in candidates}
    options = _options(candidates)
    seen: dict[str, tuple[float, float] | None] = {}
    misses = 0
    while len(seen) < len(candidates):
        if misses >= patience:  # the first untried, so a small space is not left half-seen
            first = next(c for c in candidates if c.name not in seen)
            study.enqueue_trial(_params(first, options))
        trial = study.ask()
        technique = trial.suggest_categorical("technique", sorted(options))
        choices = {
            key: values[trial.suggest_categorical(f"{technique}.{key}", list(range(len(values))))]
            for key, values in options[technique].items()
        }
        candidate = by_choices.get((technique, _key(choices)))
        if candidate is None or candidate.name in seen:  # refused by its technique, or proposed before
            values = seen.get(candidate.name) if candidate is not None else None
            if values is None:
                study.tell(trial, state=TrialState.FAIL)
            else:
                study.tell(trial, list(values))
            misses += 1
            continue
        misses = 0
        found = yield candidate
        seen[candidate.name] = (found.kl, found.decode_tok_s) if found is not None else None
        if found is None:
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, [found.kl, found.decode_tok_s])


def _options(candidates: list[Candidate]) -> dict[str, dict[str, list[Any]]]:
    """Per technique, each setting's choices in the order the space lists them."""
    options: dict[str, dict[str, list[Any]]] = {}
    for candidate in candidates:
        settings = options.setdefault(candidate.technique, {})
        for key, value in candidate.choices.items():
            if value not in settings.setdefault(key, []):
                settings[key].append(value)
    return options


def _params(candidate: Candidate, options: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """A candidate as the sampler's parameters (the technique, each setting's index among its choices)."""
    settings = options[candidate.technique]
    return {"technique": candidate.technique} | {
        f"{candidate.technique}.{key}": settings[key].index(value) for key, value in candidate.choices.items()
    }


def _key(choices: dict[str, Any]) -> str:
    return repr(sorted(choices.items(), key=lambda item: item[0]))
