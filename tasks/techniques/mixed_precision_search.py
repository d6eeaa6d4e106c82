"""The mixed-precision search (see tasks/techniques/mixed_precision.py for what it decides and why): costs per
matrix, predicted from the Fisher diagonal or measured per group (tasks/techniques/sensitivity.py), then matrices
or groups kept at 8 bits by loss saved per byte, each plan measured, until the target or the budget."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.techniques.calibration import cached_tensors
from tasks.techniques.mixed_precision import (
    SCALE_BYTES,
    VERIFY_ROUNDS,
    Matrix,
    MatrixChoice,
    PrecisionPlan,
    export_matrices,
    fake_quantize,
    matrix_bytes,
)
from tasks.techniques.sensitivity import LayerSuffixes, fisher_diagonal


@dataclass(frozen=True)
class Goal:
    """What the search aims at: the calibration perplexity increase to reach, the bytes it may spend (a share of an
    all-8-bit export's matrix bytes), and nodes at 8 bits from the start, whatever their cost (e.g. a tied lm_head,
    whose Fisher cost sees only its output role, not the embedding lookups that read the same table; their bytes
    come out of the budget and the search chooses the rest)."""

    target_ppl_increase: float
    size_budget: float
    keep_int8: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Grid:
    """How the export stores a matrix: blocks of `block` weights, symmetric or with a zero point, a scale of
    `scale_bytes` per block; `int4_weights` (torch module name → its weight as the export stores it at 4 bits, e.g.
    GPTQ-rounded) replaces round-to-nearest wherever a matrix is at 4 bits, in the costs and the measurements;
    `shared_int8_table`: whether a tied int8 lm_head's table serves the embedding lookup too (else the export keeps
    a float32 copy for it, which keeping the lm_head at int8 costs)."""

    block: int
    symmetric: bool
    scale_bytes: int = SCALE_BYTES
    int4_weights: dict[str, Any] | None = None
    shared_int8_table: bool = True


def search(
    model: Any,
    windows: list[list[int]],
    goal: Goal,
    grid: Grid,
    progress: Callable[[str, int, int], None] | None = None,
    matrices: list[Matrix] | None = None,
    measure: Callable[..., float] | None = None,
    group: Callable[[Matrix], str] | None = None,
    groups_in_torch: bool = False,
) -> PrecisionPlan:
    """The per-matrix precision plan for `model` (left as it was) from the calibration `windows`.

    `matrices`: what the export quantizes (default: the ONNX builder's nodes). `measure(plan)`: the mean loss per
    token on `windows` with each matrix at its planned bits (None: unquantized); default: the simulated grid.
    `group(matrix)`: when given, sensitivity is measured rather than predicted: each group (e.g. a layer) goes to 8
    bits alone, `measure(plan, quick=True)` (the caller's cheaper measurement: llama.cpp's uses a quarter of the
    windows) says what that saves, and the search keeps whole groups at 8 bits; every plan is still measured in
    full. A `size_budget` with no room for any unit at 8 bits is refused before anything is measured.
    `groups_in_torch`: with `group` and a `measure` of the caller's, each group's saving is measured on the
    simulated grid in torch instead (with `grid.int4_weights` as the 4-bit twin of the caller's rounding), a quarter
    of the windows; only the plans go through `measure`."""
    if not windows:
        raise ValueError("mixed_precision: the calibration split gave no token windows")
    run = _Search(model, windows, goal, grid, progress, matrices, group)
    run.measure = measure or run.simulated
    run.group_measure = run.simulated if groups_in_torch else run.measure
    return run.plan()


class _Search:
    """One search's state: the model's original weights, what each matrix costs in bytes, the units the search
    adds (matrices, or groups of them), and the measurements."""

    measure: Callable[..., float]
    group_measure: Callable[..., float]

    def __init__(
        self,
        model: Any,
        windows: list[list[int]],
        goal: Goal,
        grid: Grid,
        progress: Callable[[str, int, int], None] | None,
        matrices: list[Matrix] | None,
        group: Callable[[Matrix], str] | None,
    ) -> None:
        self.model, self.windows, self.goal, self.grid, self.progress = model, windows, goal, grid, progress
        self.matrices = export_matrices(model) if matrices is None else matrices
        self.modules = dict(model.named_modules())
        self.originals = {
            name: self.modules[name].weight.detach().clone() for m in self.matrices for name in m.modules
        }
        self.tied = model.lm_head.weight is model.get_input_embeddings().weight
        self.group = group
        self.units: dict[
            str, list[Matrix]
        ] = {}  # the search's units: one matrix each, or the measured groups
        for matrix in self.matrices:
            self.units.setdefault(group(matrix) if group else matrix.node, []).append(matrix)
        self._sizes()

    def _sizes(self) -> None:
        """Bytes at 4 and 8 bits, what keeping each unit at 8 bits adds, and the budget (refused where it leaves no
        room for the kept nodes or for any unit)."""
        grid, goal = self.grid, self.goal
        size = {
            m.node: {
                b: matrix_bytes(m.parameters, b, grid.block, grid.symmetric, grid.scale_bytes) for b in (4, 8)
            }
            for m in self.matrices
        }
        self.extra = {}
        for matrix in self.matrices:
            self.extra[matrix.node] = size[matrix.node][8] - size[matrix.node][4]
            if self.tied and matrix.node == "/lm_head/MatMul" and not grid.shared_int8_table:
                self.extra[matrix.node] += matrix.parameters * 4 - size[matrix.node][4]  # + a float32 table
        self.int8_bytes = sum(size[m.node][8] for m in self.matrices)
        self.int4_bytes = sum(size[m.node][4] for m in self.matrices)
        self.budget = goal.size_budget * self.int8_bytes - self.int4_bytes
        self.added = {unit: sum(self.extra[m.node] for m in ms) for unit, ms in self.units.items()}
        unknown = sorted(goal.keep_int8 - set(self.extra))
        if unknown:
            raise ValueError(f"mixed_precision: {unknown[0]} is not a matrix the export quantizes")
        self.kept = {u for u, ms in self.units.items() if any(m.node in goal.keep_int8 for m in ms)}
        self.pinned = sum(self.added[u] for u in self.kept)
        share = lambda extra: (self.int4_bytes + extra) / self.int8_bytes  # noqa: E731
        keep = ", ".join(sorted(goal.keep_int8))
        if self.pinned > self.budget:
            raise ValueError(
                f"mixed_precision.size_budget: {goal.size_budget} leaves no room for {keep} at 8 bits (it needs "
                f"{share(self.pinned):.1%} of the 8-bit bytes); raise it, or let the search choose (lm_head: int4)"
            )
        free = [self.added[u] for u in self.units if u not in self.kept]
        if free and min(free) > self.budget - self.pinned:  # the search could only end where it starts
            raise ValueError(
                f"mixed_precision.size_budget: {goal.size_budget} leaves no room for any "
                f"{'group' if self.group else 'matrix'} at 8 bits (all 4-bit is already {share(0):.1%} of the "
                "8-bit bytes"
                + (f", {share(self.pinned):.1%} with {keep} at 8 bits" if self.kept else "")
                + f"; the smallest needs {share(self.pinned + min(free)):.1%})"
            )

    def report(self, label: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(label, done, total)

    def set_bits(self, plan: dict[str, int]) -> None:
        import torch

        with torch.no_grad():
            for matrix in self.matrices:
                for name in matrix.modules:
                    bits = plan.get(matrix.node)
                    source = self.originals[name]
                    self.modules[name].weight.copy_(source if bits is None else self.at_bits(name, bits))

    def at_bits(self, name: str, bits: int) -> Any:
        if bits == 4 and self.grid.int4_weights is not None:
            return self.grid.int4_weights[name].to(self.originals[name])
        return fake_quantize(self.originals[name], bits, self.grid.block, self.grid.symmetric)

    def loss(self, sample: list[list[int]]) -> float:
        import torch

        total, tokens = 0.0, 0
        with torch.no_grad():
            for ids in sample:
                batch = torch.tensor([ids])
                total += self.model(input_ids=batch, labels=batch).loss.item() * (len(ids) - 1)
                tokens += len(ids) - 1
        return total / tokens

    def simulated(self, plan: dict[str, int] | None, quick: bool = False) -> float:
        self.set_bits(plan or {})
        return self.loss(self.quick_windows if quick else self.windows)  # quick: a group's saving

    @property
    def quick_windows(self) -> list[list[int]]:
        return self.windows[: max(1, len(self.windows) // 4)]

    def plan(self) -> PrecisionPlan:
        """Costs, then units added in order of loss saved per byte, each plan measured, until the target is met,
        the budget spent or the rounds run out."""
        was_training = self.model.training
        self.model.eval()
        try:
            all_int4 = {m.node: 4 for m in self.matrices}
            costs = self.predicted_costs() if self.group is None else {}
            base_loss, int4_loss = self.measure(None), self.measure(all_int4)
            if self.group is None:
                predicted_all = sum(c4 for c4, _ in costs.values())
                scale = max((int4_loss - base_loss) / predicted_all, 0.0) if predicted_all > 0 else 1.0
                costs = {node: (scale * c4, scale * c8) for node, (c4, c8) in costs.items()}
            elif int4_loss - base_loss <= math.log1p(self.goal.target_ppl_increase):  # nothing to keep
                costs = {m.node: (0.0, 0.0) for m in self.matrices}
            else:
                costs = self.measured_costs(all_int4)
            chosen = self.greedy(costs, all_int4, base_loss, int4_loss)
        finally:
            self.set_bits({})
            self.model.train(was_training)
        return self.result(chosen, costs, base_loss, int4_loss)

    def predicted_costs(self) -> dict[str, tuple[float, float]]:
        """Per matrix, the loss increase at 4 and at 8 bits from the Fisher diagonal (computed once per base and
        windows) times the squared rounding error."""
        fisher = cached_tensors(
            self.model,
            {name: self.modules[name] for name in self.originals},
            self.windows,
            fisher_diagonal,
            lambda: fisher_diagonal(
                self.model,
                self.windows,
                self.modules,
                self.originals,
                lambda i, n: self.report("sensitivity", i, n),
            ),
        )
        costs = {}
        for matrix in self.matrices:
            c4, c8 = (
                sum(
                    (fisher[name] * (self.at_bits(name, bits) - self.originals[name]) ** 2).sum().item() / 2
                    for name in matrix.modules
                )
                for bits in (4, 8)
            )
            costs[matrix.node] = (c4, c8)
        return costs

    def measured_costs(self, all_int4: dict[str, int]) -> dict[str, tuple[float, float]]:
        """Each unit's saving at 8 bits alone, measured on a quarter of the windows (from cached layer inputs
        where they give the full pass's loss), shared among its matrices by parameters (kept units too: what they
        save is reported)."""
        suffixes, starts = None, {}
        if self.group_measure == self.simulated and LayerSuffixes.usable(self.model, self.quick_windows):
            self.set_bits(all_int4)
            suffixes = LayerSuffixes(self.model, self.quick_windows)
            int4_quick = suffixes.full_loss
            starts = {
                u: suffixes.first_layer(n for m in ms for n in m.modules) for u, ms in self.units.items()
            }

            def eight_bit(unit: str) -> None:
                self.set_bits(all_int4 | {m.node: 8 for m in self.units[unit]})

            if not suffixes.agrees(starts, eight_bit, lambda: self.loss(self.quick_windows)):
                suffixes = None
        else:
            int4_quick = self.group_measure(all_int4, quick=True)
        costs = {}
        for index, (unit, members) in enumerate(self.units.items()):
            self.report("sensitivity", index, len(self.units))
            plan_8 = all_int4 | {m.node: 8 for m in members}
            if suffixes is not None and starts[unit] is not None:
                self.set_bits(plan_8)
                saving = int4_quick - suffixes.loss(starts[unit])
            else:
                saving = int4_quick - self.group_measure(plan_8, quick=True)
            weight = sum(m.parameters for m in members)
            for m in members:
                costs[m.node] = (saving * m.parameters / weight, 0.0)
        self.report("sensitivity", len(self.units), len(self.units))
        return costs

    def greedy(
        self,
        costs: dict[str, tuple[float, float]],
        all_int4: dict[str, int],
        base_loss: float,
        int4_loss: float,
    ) -> dict[str, Any]:
        """Units added by loss saved per byte while the prediction misses the target and the budget allows; each
        round's plan measured, the prediction reset to the measurement, for `VERIFY_ROUNDS` rounds at most."""
        units, added = self.units, self.added
        saved = {unit: sum(costs[m.node][0] - costs[m.node][1] for m in ms) for unit, ms in units.items()}
        order = sorted(
            (u for u in units if saved[u] > 0 and u not in self.kept),
            key=lambda u: saved[u] / added[u],
            reverse=True,
        )
        target_loss = math.log1p(self.goal.target_ppl_increase)
        plan = all_int4 | {m.node: 8 for u in self.kept for m in units[u]}
        spent, position, skipped = self.pinned, 0, False
        predicted = measured = int4_loss - base_loss
        predicted -= sum(saved[u] for u in self.kept)
        last_measured = dict(all_int4)  # what `measured` is of (a kept matrix makes the start differ)
        stopped_by = f"{VERIFY_ROUNDS} measured plans"
        for round_ in range(VERIFY_ROUNDS):
            self.report("mixed precision", round_, VERIFY_ROUNDS)
            while predicted > target_loss and position < len(order):
                unit, position = order[position], position + 1
                if spent + added[unit] > self.budget:
                    skipped = True  # does not fit; a smaller one further down may
                    continue
                plan.update({m.node: 8 for m in units[unit]})
                spent += added[unit]
                predicted -= saved[unit]
            if plan != last_measured:  # a round that added nothing keeps the last measurement
                measured, last_measured = self.measure(plan) - base_loss, dict(plan)
            if measured <= target_loss:
                stopped_by = "target met"
                break
            if position >= len(order):
                stopped_by = "size budget" if skipped else "no matrix left"
                break
            predicted = measured  # the prediction was optimistic: go on from the measurement
        self.report("mixed precision", VERIFY_ROUNDS, VERIFY_ROUNDS)
        predicted = int4_loss - base_loss - sum(saved[u] for u in units if plan[units[u][0].node] == 8)
        return {
            "plan": plan,
            "spent": spent,
            "predicted": predicted,
            "measured": measured,
            "stopped_by": stopped_by,
        }

    def result(
        self,
        chosen: dict[str, Any],
        costs: dict[str, tuple[float, float]],
        base_loss: float,
        int4_loss: float,
    ) -> PrecisionPlan:
        plan = chosen["plan"]
        choices = [
            MatrixChoice(
                m.node, plan[m.node], m.parameters, costs[m.node][0], costs[m.node][1], self.extra[m.node]
            )
            for m in self.matrices
        ]
        return PrecisionPlan(
            target_ppl_increase=self.goal.target_ppl_increase,
            size_budget=self.goal.size_budget,
            calibration_tokens=sum(len(ids) for ids in self.windows),
            fp32_loss=base_loss,
            int4_ppl_increase=math.expm1(int4_loss - base_loss),
            predicted_ppl_increase=math.expm1(max(chosen["predicted"], 0.0)),
            measured_ppl_increase=math.expm1(chosen["measured"]),
            size_ratio=(self.int4_bytes + chosen["spent"]) / self.int8_bytes,
            stopped_by=chosen["stopped_by"],
            tied_embeddings=self.tied,
            matrices=choices,
            sensitivity="measured per layer" if self.group else "predicted",
        )
