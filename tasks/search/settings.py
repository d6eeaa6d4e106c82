"""params.yaml's `search:` section, typed (read with the rest of the configuration; the space itself is checked
setting by setting when a search expands it, with errors naming `search.space.<technique>.<setting>`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from tasks.schema import Strict


class SearchConfig(Strict):
    # technique → {setting: [choices]}: every combination is a candidate (tasks/search/space.py)
    space: dict[str, dict[str, list[Any]]] = {}
    # the params.yaml variant the candidates race against; None: the fastest of the params.yaml variants on the
    # proxies' short decode among those the screen keeps (the baseline only when it is alone)
    leader: str | None = None
    max_candidates: Annotated[int, Field(ge=1, le=10_000)] = (
        64  # built and proxied at most (in the space's order)
    )
    budget_minutes: Annotated[float, Field(gt=0)] | None = None  # no new candidate is built past it
    # which candidates are built (tasks/search/sampler.py): grid (all, in order), tpe (Optuna's TPE on the proxies),
    # auto (grid when it sees the whole space: it fits max_candidates and there is no budget_minutes)
    sampler: Literal["auto", "grid", "tpe"] = "auto"
    seed: int = 0  # the tpe sampler's
    keep: Annotated[int, Field(ge=1, le=1000)] = 8  # raced after the screen
    kl_margin: Annotated[float, Field(gt=0)] = (
        15.0  # the screen: KL above kl_margin × ln(1 + max_ppl_increase)
    )
    alpha: Annotated[float, Field(gt=0, lt=0.5)] = (
        0.05  # spent over the rounds' looks; the confirmation at 1 - alpha
    )
    rounds: Annotated[int, Field(ge=1, le=20)] = 3
    pairs_per_round: Annotated[int, Field(ge=1, le=100)] = 3
    windows_per_round: Annotated[int, Field(ge=1, le=1000)] = 12
    window_tokens: Annotated[int, Field(ge=16, le=8192)] = 128  # evaluation windows of the race
    proxy_windows: Annotated[int, Field(ge=1, le=100)] = 4  # calibration windows the KL is read on
    decode_tokens: Annotated[int, Field(ge=2, le=4096)] = 32  # tokens per timed decode (proxies and pairs)
    confirm_pairs: Annotated[int, Field(ge=2, le=100)] = 6
    confirm_windows: Annotated[int, Field(ge=2, le=1000)] = 24
    # a confirmed winner of the space is registered (alias `candidate`) and judged by the champion/challenger gate,
    # as `llmopt promote VERSION` judges a version; false: only its `variants:` block is written
    promote: bool = True

    @model_validator(mode="after")
    def _space_shape(self) -> SearchConfig:
        for technique, settings in self.space.items():
            for key, choices in settings.items():
                if not choices:
                    raise ValueError(f"search.space.{technique}.{key}: at least one choice")
        return self

    def windows_needed(self) -> int:
        """Evaluation windows the race and the confirmation read (disjoint: the confirmation's are held out)."""
        return self.rounds * self.windows_per_round + self.confirm_windows
