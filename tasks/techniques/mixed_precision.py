"""Accuracy-aware mixed precision for 4-bit exports: which weight matrices stay at 8 bits.

Starting from all-4-bit, every matrix the export quantizes (for the ONNX model builder one MatMulNBits node: a
layer's fused q/k/v, its o_proj, gate, up, down, and the lm_head; for llama.cpp one GGUF tensor) gets two costs on
the calibration split only:
- the loss increase it causes at int4 and at int8, predicted from the diagonal of the empirical Fisher
  information (squared per-window gradients) times the squared rounding error of the simulated grid, the way
  Fisher-weighted mixed-precision methods rank layers;
- the bytes it adds at int8.
The prediction is scaled to the all-int4 loss increase actually measured, then matrices are kept at int8 in order of
loss saved per byte until the predicted perplexity increase fits `target_ppl_increase` or the size budget is spent.
Each plan is measured again on the calibration windows and the search goes on while the measurement misses the
target. By default a plan is measured on the simulated grid in torch (exactly onnxruntime's blockwise rounding); the
llama.cpp step passes a `measure` that quantizes the GGUF with the plan and scores it in llama.cpp itself (its
importance-matrix rounding has no torch twin). The evaluation split is never seen here: the build step receives the
calibration split only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from tasks.schema import Strict
from tasks.techniques.calibration import cached_tensors

SCALE_BYTES = 4  # the builder's MatMulNBits scales are in the float32 I/O type on CPU
VERIFY_ROUNDS = 8  # measured plans before the search stops adding matrices


class MixedPrecision(Strict):
    """int4 with the weight matrices that cost the most accuracy kept at int8, chosen on the calibration split
    (tasks/techniques/mixed_precision.py): until the calibration perplexity increase fits the target, or the bytes the
    budget allows are spent."""

    target_ppl_increase: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.02  # below the gate's budget
    size_budget: Annotated[float, Field(gt=0.0, le=1.0)] = 0.6  # share of the all-int8 matrices' bytes
    windows: Annotated[int, Field(ge=1, le=4096)] = 16  # calibration windows the search measures on ...
    window_tokens: Annotated[int, Field(ge=16, le=8192)] = 256  # ... of this many tokens
    # each unit's saving at 8 bits: predicted per matrix from the Fisher diagonal, or measured per decoder layer (and
    # the lm_head) on a quarter of the windows: in the engine (`measured`; for ONNX that is the simulated grid, which
    # is its exact twin) or, for llama.cpp, on its torch twin (`simulated`: importance-weighted Q4_0-style scales,
    # the plans still measured in llama.cpp); null: predicted for ONNX, measured for llama.cpp
    sensitivity: Literal["predicted", "measured", "simulated"] | None = None


@dataclass(frozen=True)
class Matrix:
    """One quantized matrix of the export (a MatMulNBits node, a GGUF tensor) and the torch weights it is built from."""

    node: str  # the export's name, e.g. /model/layers.3/attn/qkv_proj/MatMul or blk.3.attn_q.weight
    modules: tuple[str, ...]  # torch module names whose weights it holds (q, k, v are fused into one node)
    parameters: int


@dataclass
class MatrixChoice:
    node: str
    bits: int
    parameters: int
    int4_cost: (
        float  # predicted loss increase (nats/token) at int4, after scaling to the measured all-int4 increase
    )
    int8_cost: float
    extra_bytes: int  # what keeping it at int8 adds


@dataclass
class PrecisionPlan:
    """The search's outcome: the per-matrix bits and the figures it was chosen on (all on calibration windows)."""

    target_ppl_increase: float
    size_budget: float  # share of the all-int8 weight bytes the plan may use
    calibration_tokens: int
    fp32_loss: float
    int4_ppl_increase: float  # measured, every matrix at int4
    predicted_ppl_increase: float  # of the chosen plan
    measured_ppl_increase: float  # of the chosen plan
    size_ratio: float  # the plan's weight bytes / the all-int8 weight bytes (matrices only)
    stopped_by: str  # "target met", "size budget", "no matrix left"
    tied_embeddings: (
        bool  # the lm_head's table is the embedding's (stored once, int4, while the lm_head is int4)
    )
    matrices: list[MatrixChoice] = field(default_factory=list)
    kept_as: str = "int8"  # what the export stores an 8-bit matrix as (llama.cpp: Q8_0)
    sensitivity: str = "predicted"  # each matrix's saving: "predicted" (Fisher) or "measured per layer"

    @property
    def int8_nodes(self) -> list[str]:
        return [m.node for m in self.matrices if m.bits == 8]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tensor_types(self) -> dict[str, str]:
        """llama.cpp: the tensors the plan keeps at 8 bits → their type (the rest keep llama.cpp's own choice for
        the file type: Q4_0 with an importance matrix stores the first layers' ffn_down as Q4_1)."""
        return {m.node: self.kept_as for m in self.matrices if m.bits == 8}

    def builder_options(self) -> dict[str, Any]:
        """`--target_options` of ONNX Runtime GenAI's model builder: these nodes at int8, the rest at int4."""
        return int8_overrides(self.int8_nodes, self.tied_embeddings)

    def note(self) -> str:
        kept = len(self.int8_nodes)
        return (
            f"mixed precision: {kept} of {len(self.matrices)} matrices kept at {self.kept_as} (stopped by "
            f"{self.stopped_by}); "
            f"calibration perplexity +{self.measured_ppl_increase:.1%} measured (+{self.predicted_ppl_increase:.1%} "
            f"predicted, +{self.int4_ppl_increase:.1%} all-int4), {self.size_ratio:.0%} of int8's weight bytes"
        )


def int8_overrides(nodes: list[str], tied: bool) -> dict[str, Any]:
    """The model builder's `--target_options` keeping `nodes` at int8 in an int4 export. op_types are named, or the
    structured config quantizes MatMuls only and an embedding is stored float32; but a tied model's embedding is
    left to the builder's float Gather when its lm_head is int8 (builder 0.18 writes an invalid graph for an int8
    shared table), which tasks/engines/onnx/weights.py then points at the lm_head's int8 table where it can."""
    op_types = ["MatMul"] if tied and "/lm_head/MatMul" in nodes else ["MatMul", "Gather"]
    overrides = [{"match": {"name": node}, "type": "int8"} for node in nodes]
    return {"quant_config": {"weights": {"op_types": op_types, "overrides": overrides}}}


def export_matrices(model: Any) -> list[Matrix]:
    """The MatMulNBits nodes the model builder makes for a Llama-style decoder, in graph order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        raise ValueError(
            f"mixed_precision: supports Llama-style decoders (model.layers[i].self_attn/.mlp), not "
            f"{type(model).__name__}"
        )
    names = {module: name for name, module in model.named_modules()}
    matrices = []

    def add(node: str, modules: list[Any]) -> None:
        parameters = sum(module.weight.numel() for module in modules)
        matrices.append(Matrix(node, tuple(names[module] for module in modules), parameters))

    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"/model/layers.{i}/attn/qkv_proj/MatMul", [attn.q_proj, attn.k_proj, attn.v_proj])
        add(f"/model/layers.{i}/attn/o_proj/MatMul", [attn.o_proj])
        for projection in ("gate_proj", "up_proj", "down_proj"):
            add(f"/model/layers.{i}/mlp/{projection}/MatMul", [getattr(mlp, projection)])
    add("/lm_head/MatMul", [model.lm_head])
    return matrices


def export_layer_of(matrix: Matrix) -> str:
    """The decoder layer (or the lm_head) an ONNX export's node belongs to (/model/layers.3/mlp/down_proj/MatMul →
    layers.3): the unit a measured search keeps at 8 bits."""
    parts = matrix.node.split("/")
    return parts[2] if len(parts) > 2 and parts[1] == "model" and parts[2].startswith("layers.") else parts[1]


def fake_quantize(weight: Any, bits: int, block: int, symmetric: bool) -> Any:
    """`weight` (out × in) rounded to the MatMulNBits grid: blocks of `block` inputs, one scale each (symmetric:
    the largest magnitude maps to the most negative level, as onnxruntime's blockwise quantizer does)."""
    import torch
    import torch.nn.functional as F

    rows, columns = weight.shape
    padded = F.pad(weight.detach().float(), (0, (-columns) % block)).reshape(rows, -1, block)
    if symmetric:
        levels = 2 ** (bits - 1)
        peak = padded.gather(-1, padded.abs().argmax(-1, keepdim=True))
        scale = peak / -levels
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        rounded = (padded / scale).round().clamp(-levels, levels - 1) * scale
    else:
        top = 2**bits - 1
        low, high = padded.amin(-1, keepdim=True).clamp(max=0), padded.amax(-1, keepdim=True).clamp(min=0)
        scale = (high - low) / top
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = (-low / scale).round().clamp(0, top)
        rounded = ((padded / scale).round() + zero).clamp(0, top).sub(zero) * scale
    return rounded.reshape(rows, -1)[:, :columns].to(weight.dtype)


def matrix_bytes(
    parameters: int, bits: int, block: int, symmetric: bool, scale_bytes: int = SCALE_BYTES
) -> int:
    blocks = math.ceil(parameters / block)
    zero_points = 0 if symmetric else math.ceil(blocks * bits / 8)
    return parameters * bits // 8 + blocks * scale_bytes + zero_points


def search(
    model: Any,
    windows: list[list[int]],
    target_ppl_increase: float,
    size_budget: float,
    block: int,
    symmetric: bool,
    progress: Callable[[str, int, int], None] | None = None,
    matrices: list[Matrix] | None = None,
    measure: Callable[..., float] | None = None,
    scale_bytes: int = SCALE_BYTES,
    group: Callable[[Matrix], str] | None = None,
    int4_weights: dict[str, Any] | None = None,
    shared_int8_table: bool = True,
    keep_int8: frozenset[str] = frozenset(),
    groups_in_torch: bool = False,
) -> PrecisionPlan:
    """The per-matrix precision plan for `model` (left as it was) from the calibration `windows`.

    `matrices`: what the export quantizes (default: the ONNX builder's nodes). `measure(plan)`: the mean loss per
    token on `windows` with each matrix at its planned bits (None: unquantized); default: the simulated grid.
    `group(matrix)`: when given, sensitivity is measured rather than predicted: each group (e.g. a layer) goes to 8
    bits alone, `measure(plan, quick=True)` (the caller's cheaper measurement: llama.cpp's uses a quarter of the
    windows) says what that saves, and the search keeps whole groups at 8 bits; every plan is still measured in
    full. A `size_budget` with no room for any unit at 8 bits is refused before anything is measured.
    `int4_weights` (torch module name → its weight as the export stores it at 4 bits, e.g. GPTQ-rounded): used
    instead of round-to-nearest wherever a matrix is at 4 bits, in the costs and the measurements.
    `shared_int8_table`: whether a tied int8 lm_head's table serves the embedding lookup too (else the export keeps
    a float32 copy for it, which keeping the lm_head at int8 costs).
    `keep_int8`: nodes at 8 bits from the start, whatever their cost (e.g. a tied lm_head, whose Fisher cost sees
    only its output role, not the embedding lookups that read the same table); their bytes come out of the budget
    and the search chooses the rest.
    `groups_in_torch`: with `group` and a `measure` of the caller's, each group's saving is measured on the
    simulated grid in torch instead (with `int4_weights` as the 4-bit twin of the caller's rounding), a quarter of
    the windows; only the plans go through `measure`."""
    import torch

    if not windows:
        raise ValueError("mixed_precision: the calibration split gave no token windows")
    matrices = export_matrices(model) if matrices is None else matrices
    modules = dict(model.named_modules())
    originals = {name: modules[name].weight.detach().clone() for m in matrices for name in m.modules}
    tied = model.lm_head.weight is model.get_input_embeddings().weight

    def report(label: str, done: int, total: int) -> None:
        if progress is not None:
            progress(label, done, total)

    def set_bits(plan: dict[str, int]) -> None:
        with torch.no_grad():
            for matrix in matrices:
                for name in matrix.modules:
                    weight = modules[name].weight
                    bits = plan.get(matrix.node)
                    source = originals[name]
                    weight.copy_(source if bits is None else at_bits(name, bits))

    def at_bits(name: str, bits: int) -> Any:
        if bits == 4 and int4_weights is not None:
            return int4_weights[name].to(originals[name])
        return fake_quantize(originals[name], bits, block, symmetric)

    def loss(sample: list[list[int]]) -> float:
        total, tokens = 0.0, 0
        with torch.no_grad():
            for ids in sample:
                batch = torch.tensor([ids])
                total += model(input_ids=batch, labels=batch).loss.item() * (len(ids) - 1)
                tokens += len(ids) - 1
        return total / tokens

    def simulated(plan: dict[str, int] | None, quick: bool = False) -> float:
        set_bits(plan or {})
        return loss(windows[: max(1, len(windows) // 4)] if quick else windows)  # quick: a group's saving

    measure = measure or simulated
    group_measure = simulated if groups_in_torch else measure  # a group's saving, on a quarter of the windows
    size = {
        m.node: {bits: matrix_bytes(m.parameters, bits, block, symmetric, scale_bytes) for bits in (4, 8)}
        for m in matrices
    }
    extra = {}
    for matrix in matrices:
        extra[matrix.node] = size[matrix.node][8] - size[matrix.node][4]
        if tied and matrix.node == "/lm_head/MatMul" and not shared_int8_table:
            extra[matrix.node] += matrix.parameters * 4 - size[matrix.node][4]  # + a float32 embedding table
    int8_bytes = sum(size[m.node][8] for m in matrices)
    int4_bytes = sum(size[m.node][4] for m in matrices)
    budget = size_budget * int8_bytes - int4_bytes
    # the search's units: one matrix each, or the groups whose savings are measured
    units: dict[str, list[Matrix]] = {}
    for matrix in matrices:
        units.setdefault(group(matrix) if group else matrix.node, []).append(matrix)
    added = {unit: sum(extra[m.node] for m in members) for unit, members in units.items()}
    unknown = sorted(keep_int8 - set(extra))
    if unknown:
        raise ValueError(f"mixed_precision: {unknown[0]} is not a matrix the export quantizes")
    kept = {u for u, members in units.items() if any(m.node in keep_int8 for m in members)}
    pinned = sum(added[u] for u in kept)
    if pinned > budget:
        raise ValueError(
            f"mixed_precision.size_budget: {size_budget} leaves no room for {', '.join(sorted(keep_int8))} at "
            f"8 bits (it needs {(int4_bytes + pinned) / int8_bytes:.1%} of the 8-bit bytes); raise it, or let "
            f"the search choose (lm_head: int4)"
        )
    free = [added[u] for u in units if u not in kept]
    if free and min(free) > budget - pinned:  # the search could only end where it starts
        smallest = pinned + min(free)
        raise ValueError(
            f"mixed_precision.size_budget: {size_budget} leaves no room for any {'group' if group else 'matrix'} "
            f"at 8 bits (all 4-bit is already {int4_bytes / int8_bytes:.1%} of the 8-bit bytes"
            + (
                f", {(int4_bytes + pinned) / int8_bytes:.1%} with {', '.join(sorted(keep_int8))} at 8 bits"
                if kept
                else ""
            )
            + f"; the smallest needs {(int4_bytes + smallest) / int8_bytes:.1%})"
        )

    was_training = model.training
    model.eval()
    try:
        all_int4 = {m.node: 4 for m in matrices}
        costs: dict[str, tuple[float, float]] = {}  # per matrix: loss increase at 4 and at 8 bits
        if group is None:
            fisher = cached_tensors(  # the same for every plan of this base and data: computed once
                model,
                {name: modules[name] for name in originals},
                windows,
                _fisher_diagonal,
                lambda: _fisher_diagonal(
                    model, windows, modules, originals, lambda i, n: report("sensitivity", i, n)
                ),
            )
            for matrix in matrices:
                c4, c8 = (
                    sum(
                        (fisher[name] * (at_bits(name, bits) - originals[name]) ** 2).sum().item() / 2
                        for name in matrix.modules
                    )
                    for bits in (4, 8)
                )
                costs[matrix.node] = (c4, c8)
        base_loss = measure(None)
        int4_loss = measure(all_int4)
        if group is None:
            predicted_all = sum(c4 for c4, _ in costs.values())
            scale = max((int4_loss - base_loss) / predicted_all, 0.0) if predicted_all > 0 else 1.0
            costs = {node: (scale * c4, scale * c8) for node, (c4, c8) in costs.items()}
        elif int4_loss - base_loss <= math.log1p(target_ppl_increase):  # nothing to keep: no per-group runs
            costs = {m.node: (0.0, 0.0) for m in matrices}
        else:
            quick_windows = windows[: max(1, len(windows) // 4)]
            suffixes, starts = None, {}
            if group_measure is simulated and LayerSuffixes.usable(
                model, quick_windows
            ):  # from cached inputs
                set_bits(all_int4)
                suffixes = LayerSuffixes(model, quick_windows)
                int4_quick = suffixes.full_loss
                starts = {
                    unit: suffixes.first_layer(n for m in ms for n in m.modules) for unit, ms in units.items()
                }

                def eight_bit(unit: str) -> None:
                    set_bits(all_int4 | {m.node: 8 for m in units[unit]})

                if not suffixes.agrees(starts, eight_bit, lambda: loss(quick_windows)):
                    suffixes = None
            else:
                int4_quick = group_measure(all_int4, quick=True)
            # kept units too: what they save is reported
            for index, (unit, members) in enumerate(units.items()):
                report("sensitivity", index, len(units))
                plan_8 = all_int4 | {m.node: 8 for m in members}
                if suffixes is not None and starts[unit] is not None:
                    set_bits(plan_8)
                    saving = int4_quick - suffixes.loss(starts[unit])
                else:
                    saving = int4_quick - group_measure(plan_8, quick=True)
                weight = sum(m.parameters for m in members)
                for m in members:  # a group's measured saving, shared by parameters (for the report)
                    costs[m.node] = (saving * m.parameters / weight, 0.0)
            suffixes = None  # the cached layer inputs are not needed by the plans
            report("sensitivity", len(units), len(units))
        saved = {
            unit: sum(costs[m.node][0] - costs[m.node][1] for m in members) for unit, members in units.items()
        }
        order = sorted(
            (u for u in units if saved[u] > 0 and u not in kept),
            key=lambda u: saved[u] / added[u],
            reverse=True,
        )
        target_loss = math.log1p(target_ppl_increase)
        plan = all_int4 | {m.node: 8 for u in kept for m in units[u]}
        spent, position, skipped = pinned, 0, False
        predicted = measured = int4_loss - base_loss
        predicted -= sum(saved[u] for u in kept)
        last_measured = dict(all_int4)  # what `measured` is of (a kept matrix makes the start differ)
        stopped_by = f"{VERIFY_ROUNDS} measured plans"
        for round_ in range(VERIFY_ROUNDS):
            report("mixed precision", round_, VERIFY_ROUNDS)
            while predicted > target_loss and position < len(order):
                unit, position = order[position], position + 1
                if spent + added[unit] > budget:
                    skipped = True  # does not fit; a smaller one further down may
                    continue
                plan.update({m.node: 8 for m in units[unit]})
                spent += added[unit]
                predicted -= saved[unit]
            if plan != last_measured:  # a round that added nothing keeps the last measurement
                measured, last_measured = measure(plan) - base_loss, dict(plan)
            if measured <= target_loss:
                stopped_by = "target met"
                break
            if position >= len(order):
                stopped_by = "size budget" if skipped else "no matrix left"
                break
            predicted = measured  # the prediction was optimistic: go on from the measurement
        report("mixed precision", VERIFY_ROUNDS, VERIFY_ROUNDS)
        predicted = int4_loss - base_loss - sum(saved[u] for u in units if plan[units[u][0].node] == 8)
    finally:
        set_bits({})
        model.train(was_training)

    choices = [
        MatrixChoice(m.node, plan[m.node], m.parameters, costs[m.node][0], costs[m.node][1], extra[m.node])
        for m in matrices
    ]
    return PrecisionPlan(
        target_ppl_increase=target_ppl_increase,
        size_budget=size_budget,
        calibration_tokens=sum(len(ids) for ids in windows),
        fp32_loss=base_loss,
        int4_ppl_increase=math.expm1(int4_loss - base_loss),
        predicted_ppl_increase=math.expm1(max(predicted, 0.0)),
        measured_ppl_increase=math.expm1(measured),
        size_ratio=(int4_bytes + spent) / int8_bytes,
        stopped_by=stopped_by,
        tied_embeddings=tied,
        matrices=choices,
        sensitivity="measured per layer" if group else "predicted",
    )


class LayerSuffixes:
    """The hidden states entering each decoder layer over `windows`, with the model's weights as they are now, so a
    change confined to layers ≥ L is measured by running layers L.. only: the layers before L give exactly these
    inputs again. Measuring every decoder layer's saving this way runs half the layers a full pass would."""

    MAX_CACHED_BYTES = 1 << 30  # the layer inputs kept (float32): beyond this, full passes instead

    @classmethod
    def usable(cls, model: Any, windows: list[list[int]]) -> bool:
        """Whether the shortcut applies: a decoder whose layers are all of one kind (a model that picks each
        layer's mask or rotary table by its index in the stack, e.g. sliding and full attention interleaved, would
        give a suffix's layers the wrong ones) and layer inputs that fit `MAX_CACHED_BYTES`."""
        config = getattr(model, "config", None)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if config is None or layers is None or len(set(getattr(config, "layer_types", None) or [None])) > 1:
            return False
        cached = sum(len(ids) for ids in windows) * config.hidden_size * len(layers) * 4
        return cached <= cls.MAX_CACHED_BYTES

    def __init__(self, model: Any, windows: list[list[int]]) -> None:
        import torch

        self.model, self.windows = model, windows
        self.layers = model.model.layers
        names = {id(module): name for name, module in model.named_modules()}
        self.prefixes = [names[id(layer)] + "." for layer in self.layers]
        self.inputs: list[list[Any]] = [[None] * len(self.layers) for _ in windows]
        current = [0]

        def keep(index: int) -> Callable[..., None]:
            def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                self.inputs[current[0]][index] = hidden.detach().clone()

            return hook

        handles = [
            layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(self.layers)
        ]
        total, tokens = 0.0, 0
        try:
            with torch.no_grad():
                for current[0], ids in enumerate(windows):
                    batch = torch.tensor([ids])
                    total += model(input_ids=batch, labels=batch).loss.item() * (len(ids) - 1)
                    tokens += len(ids) - 1
        finally:
            for handle in handles:
                handle.remove()
        self.full_loss = total / tokens

    def first_layer(self, module_names: Any) -> int | None:
        """The first decoder layer holding any of `module_names`; None when one is outside the decoder layers (an
        embedding, an lm_head: tied or not, the whole pass is measured)."""
        found = []
        for name in module_names:
            index = next((i for i, prefix in enumerate(self.prefixes) if name.startswith(prefix)), None)
            if index is None:
                return None
            found.append(index)
        return min(found) if found else None

    def loss(self, start: int) -> float:
        """Mean loss per token over the windows running layers `start`.. (and the final norm and head) from the
        cached inputs of layer `start`."""
        import torch

        decoder = self.model.model
        total, tokens = 0.0, 0
        try:
            decoder.layers = torch.nn.ModuleList(list(self.layers)[start:])
            with torch.no_grad():
                for ids, inputs in zip(self.windows, self.inputs, strict=True):
                    batch = torch.tensor([ids])
                    out = self.model(inputs_embeds=inputs[start], labels=batch, use_cache=False)
                    total += out.loss.item() * (len(ids) - 1)
                    tokens += len(ids) - 1
        finally:
            decoder.layers = self.layers
        return total / tokens

    def agrees(
        self, starts: dict[str, int | None], set_unit: Callable[[str], None], full: Callable[[], float]
    ) -> bool:
        """Whether the shortcut gives the full pass's loss for the unit that skips the most layers (a model whose
        layers depend on more than their input, e.g. on their position in the stack, must not use it)."""
        inside = {unit: start for unit, start in starts.items() if start}
        if not inside:
            return False
        unit = max(inside, key=inside.__getitem__)
        set_unit(unit)
        return math.isclose(self.loss(inside[unit]), full(), rel_tol=1e-6, abs_tol=1e-9)


def _fisher_diagonal(
    model: Any,
    windows: list[list[int]],
    modules: dict[str, Any],
    originals: dict[str, Any],
    progress: Callable[[int, int], None],
) -> dict[str, Any]:
    """Mean squared per-window gradient of the loss for every weight the export quantizes."""
    import torch

    weights = {name: modules[name].weight for name in originals}
    fisher = {name: torch.zeros_like(weight) for name, weight in weights.items()}
    requires = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    for parameter, _ in requires:
        parameter.requires_grad_(False)
    for weight in weights.values():
        weight.requires_grad_(True)
    try:
        for i, ids in enumerate(windows):
            progress(i, len(windows))
            batch = torch.tensor([ids])
            gradients = torch.autograd.grad(
                model(input_ids=batch, labels=batch).loss, list(weights.values()), allow_unused=True
            )
            for name, gradient in zip(weights, gradients, strict=True):
                if gradient is not None:
                    fisher[name] += gradient.detach() ** 2 / len(windows)
        progress(len(windows), len(windows))
    finally:
        for parameter, required in requires:
            parameter.requires_grad_(required)
    return fisher
