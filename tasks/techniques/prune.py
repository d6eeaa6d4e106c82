"""prune: remove weights from a Llama-architecture causal LM, unstructured (zeros) or structured (smaller matrices).

Unstructured pruning only writes zeros into dense matrices: the file and the matmuls keep their size. Structured
pruning physically removes MLP neurons and grouped-query attention groups, the same number in every decoder layer
(a Llama config has one `intermediate_size` and one head count for all layers), so the result is an ordinary,
smaller Llama that `from_pretrained` loads and every engine runs. Embeddings and `lm_head` are never pruned: they
are tied, and the vocabulary projection is where small models are most sensitive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from tasks.schema import Strict
from tasks.techniques.calibration import WINDOW_TOKENS, capture_inputs, mean_absolute
from tasks.techniques.registry import Applied, Row, Technique, register, step_arguments

UNSTRUCTURED_NOTE = (
    "Unstructured pruning writes zeros into dense matrices: safetensors stores the zeros, so size on disk and "
    "speed do not change without sparse kernels; only accuracy is affected."
)
STRUCTURED_NOTE = (
    "Structured pruning removed whole MLP neurons and attention groups: the matrices are physically smaller, so "
    "size on disk and compute per token shrink; accuracy must be re-measured (heal first)."
)


class PruneStep(Strict):
    """Magnitude pruning: `unstructured` zeros weights (same size and speed without sparse kernels); `structured`
    removes MLP neurons / grouped-query attention groups, the same number in every layer (smaller matrices)."""

    method: Literal["unstructured", "structured"]
    sparsity: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5  # unstructured: share of weights zeroed
    scope: Literal["global", "layer"] = "global"  # unstructured: one threshold, or one per layer
    # structured: share of MLP neurons and number of KV groups (KV head + its queries) removed in every layer.
    # Both default to 0 (remove nothing) and at least one must be set: how much to cut is the user's call.
    mlp_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    head_groups: Annotated[int, Field(ge=0)] = 0
    importance: Literal["magnitude", "activation"] = (
        "activation"  # structured: activations on calibration text
    )
    # structured with activation importance: calibration windows (of 256 tokens) the activations are measured on
    calibration_windows: Annotated[int, Field(ge=1, le=4096)] = 16
    heal_steps: Annotated[int, Field(ge=0, le=100_000)] = 0  # fine-tune on the calibration split afterwards
    heal_lr: Annotated[float, Field(gt=0.0, le=1.0)] = 5e-5

    @model_validator(mode="after")
    def _fields_of_the_method(self) -> PruneStep:
        own = {
            "unstructured": ("sparsity", "scope"),
            "structured": ("mlp_fraction", "head_groups", "importance"),
        }
        other = "structured" if self.method == "unstructured" else "unstructured"
        foreign = [name for name in own[other] if name in self.model_fields_set]
        if foreign:
            raise ValueError(f"{foreign[0]} does not apply to method {self.method}")
        if "calibration_windows" in self.model_fields_set and (self.method, self.importance) != (
            "structured",
            "activation",
        ):
            raise ValueError("calibration_windows applies to method structured with importance activation")
        if self.method == "structured" and not (self.mlp_fraction or self.head_groups):
            raise ValueError("structured pruning needs mlp_fraction > 0 or head_groups > 0")
        return self


@register
class Prune(Technique):
    name = "prune"
    settings = PruneStep
    role = "transform"

    def apply(self, model: Any, settings: PruneStep, context: Any) -> Applied:
        from tasks.weights.safetensors import HF_SAFETENSORS

        cfg, tokenizer = settings, context.tokenizer
        with step_arguments(self.name):
            if cfg.method == "unstructured":
                report = prune_unstructured(model, cfg.sparsity, cfg.scope)
            else:
                activation = cfg.importance == "activation"
                calibration = (
                    context.sequences(tokenizer, WINDOW_TOKENS, limit=cfg.calibration_windows)
                    if activation
                    else None
                )
                report = prune_structured(
                    model, cfg.mlp_fraction, cfg.head_groups, cfg.importance, calibration
                )
        note = f"{report.method}: {report.parameters_before:,} → {report.parameters_after:,} parameters, "
        note += f"{report.sparsity:.1%} zeros in decoder matrices. {report.note}"
        if cfg.heal_steps:
            steps, batches = cfg.heal_steps, context.sequences(tokenizer, WINDOW_TOKENS)
            losses = heal(model, batches, steps, cfg.heal_lr, lambda i, _: context.report("heal", i, steps))
            context.history["heal_loss"] = losses
            note += f" Healed {steps} steps: loss {losses[0]:.3f} → {losses[-1]:.3f}."
        return Applied(model, HF_SAFETENSORS, note)

    def rows(self) -> list[Row]:
        return [
            Row(
                "`prune: {method: unstructured}`",
                ("sparsity", "scope"),
                "L1-magnitude zeros in every decoder `nn.Linear` (embeddings untouched); **same size and speed** "
                "without sparse kernels: the manifest says so",
            ),
            Row(
                "`prune: {method: structured}`",
                ("mlp_fraction", "head_groups", "importance", "calibration_windows", "heal_steps", "heal_lr"),
                "physically removes the least important MLP neurons and grouped-query attention groups (a KV head "
                "with its query heads), the same number in every layer, so the config stays a valid Llama that "
                "`from_pretrained` reloads; importance = mean \\|activation\\| on the calibration split (or weight "
                "magnitude); optional healing fine-tune (loss curve logged)",
                "(set `mlp_fraction` or `head_groups`: how much to cut is yours to say)",
            ),
        ]


@dataclass(frozen=True)
class PruneReport:
    """What a pruning step did: parameter counts, achieved sparsity and config changes (before, after)."""

    method: str
    parameters_before: int
    parameters_after: int
    sparsity: float  # fraction of zeros over the prunable matrices (decoder-layer nn.Linear weights)
    model_sparsity: float  # fraction of zeros over every parameter of the model
    note: str
    config_changes: dict[str, tuple[int, int]] = field(default_factory=dict)


def decoder_linears(model: Any) -> list[Any]:
    """Every nn.Linear inside the decoder layers: the matrices pruning may touch (not embeddings or lm_head)."""
    import torch

    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def prune_unstructured(model: Any, sparsity: float, scope: Literal["global", "layer"]) -> PruneReport:
    """Zero the smallest-|w| fraction `sparsity` of decoder weights, ranked across all layers or per matrix."""
    import torch
    from torch.nn.utils import prune

    _check_fraction("sparsity", sparsity)
    if scope not in ("global", "layer"):
        raise ValueError(f"scope: must be 'global' or 'layer', got {scope!r}")
    before = count_parameters(model)
    targets = [(linear, "weight") for linear in decoder_linears(model)]
    with torch.no_grad():
        if scope == "global":
            prune.global_unstructured(targets, pruning_method=prune.L1Unstructured, amount=sparsity)
        else:
            for linear, name in targets:
                prune.l1_unstructured(linear, name, amount=sparsity)
        for linear, name in targets:
            prune.remove(linear, name)
    return PruneReport(
        method=f"unstructured-l1-{scope}",
        parameters_before=before,
        parameters_after=count_parameters(model),
        sparsity=_zero_fraction([linear.weight for linear, _ in targets]),
        model_sparsity=_zero_fraction(list(model.parameters())),
        note=UNSTRUCTURED_NOTE,
    )


def prune_structured(
    model: Any,
    mlp_fraction: float,
    head_groups: int,
    importance: Literal["magnitude", "activation"],
    calibration: list[list[int]] | None,
) -> PruneReport:
    """Remove the least important `mlp_fraction` of MLP neurons and `head_groups` KV groups from every layer."""
    config = model.config
    neurons, groups = _check_structured_arguments(config, mlp_fraction, head_groups, importance, calibration)
    before = count_parameters(model)
    old = {k: getattr(config, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")}
    if importance == "activation":
        neuron_scores, group_scores = activation_importance(model, calibration or [])
    else:
        neuron_scores, group_scores = magnitude_importance(model)
    for layer, neuron_score, group_score in zip(model.model.layers, neuron_scores, group_scores, strict=True):
        _keep_mlp_neurons(layer.mlp, _top_indices(neuron_score, neurons))
        _keep_attention_groups(layer.self_attn, _top_indices(group_score, groups))
    _update_config(model, neurons, groups)
    return PruneReport(
        method=f"structured-{importance}",
        parameters_before=before,
        parameters_after=count_parameters(model),
        sparsity=_zero_fraction([linear.weight for linear in decoder_linears(model)]),
        model_sparsity=_zero_fraction(list(model.parameters())),
        note=STRUCTURED_NOTE,
        config_changes={k: (v, getattr(config, k)) for k, v in old.items()},
    )


def heal(
    model: Any,
    batches: list[list[int]],
    steps: int,
    lr: float,
    on_step: Callable[[int, float], None] | None,
) -> list[float]:
    """Short causal-LM fine-tune after pruning (one token sequence per AdamW step, cycling); the loss per step."""
    import torch

    if not batches or any(len(ids) < 2 for ids in batches):
        raise ValueError("batches: need at least one token sequence, each of at least 2 tokens")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        ids = torch.tensor([batches[step % len(batches)]], device=model.device)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    return losses


def magnitude_importance(model: Any) -> tuple[list[Any], list[Any]]:
    """Per layer: L2 norm of each MLP neuron's weights and of each KV group's q/k/v/o weights."""
    import torch

    neuron_scores, group_scores = [], []
    with torch.no_grad():
        for layer in model.model.layers:
            mlp, attn = layer.mlp, layer.self_attn
            squares = mlp.gate_proj.weight.pow(2).sum(1) + mlp.up_proj.weight.pow(2).sum(1)
            neuron_scores.append((squares + mlp.down_proj.weight.pow(2).sum(0)).sqrt())
            q, o = _per_group(attn.q_proj.weight, attn), _per_group(attn.o_proj.weight.T, attn)
            k, v = _per_group(attn.k_proj.weight, attn), _per_group(attn.v_proj.weight, attn)
            group_scores.append(sum(w.pow(2).sum(1) for w in (q, k, v, o)).sqrt())
    return neuron_scores, group_scores


def activation_importance(model: Any, calibration: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """Per layer: mean |input| of down_proj per neuron and of o_proj per KV group, over the calibration tokens."""
    layers = model.model.layers
    modules = {f"{index}.mlp": layer.mlp.down_proj for index, layer in enumerate(layers)}
    modules |= {f"{index}.attn": layer.self_attn.o_proj for index, layer in enumerate(layers)}
    found = capture_inputs(model, modules, calibration, mean_absolute)
    neurons = [found.sums[f"{index}.mlp"] / found.tokens for index in range(len(layers))]
    pairs = [(found.sums[f"{index}.attn"], layer.self_attn) for index, layer in enumerate(layers)]
    groups = [_per_group(total.unsqueeze(1), attn).sum(1) / found.tokens for total, attn in pairs]
    return neurons, groups


def count_parameters(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def _per_group(rows: Any, attn: Any) -> Any:
    """View q/k/v rows or o_proj columns (as rows) as one row per KV group: query head h belongs to group h // ratio."""
    return rows.reshape(attn.k_proj.out_features // attn.head_dim, -1)


def _top_indices(scores: Any, remove: int) -> Any:
    """Indices of the `len(scores) - remove` highest scores, in their original order."""
    import torch

    return torch.topk(scores, len(scores) - remove).indices.sort().values


def _keep_mlp_neurons(mlp: Any, keep: Any) -> None:
    """Keep the intermediate neurons `keep`: rows of gate_proj and up_proj, columns of down_proj."""
    _slice_linear(mlp.gate_proj, rows=keep)
    _slice_linear(mlp.up_proj, rows=keep)
    _slice_linear(mlp.down_proj, columns=keep)
    mlp.intermediate_size = len(keep)


def _keep_attention_groups(attn: Any, keep: Any) -> None:
    """Keep the KV heads `keep` and, for each, its block of num_attention_heads / num_key_value_heads query heads."""
    import torch

    kv_span = attn.head_dim
    q_span = kv_span * attn.num_key_value_groups
    q_rows = (keep[:, None] * q_span + torch.arange(q_span)).flatten()
    kv_rows = (keep[:, None] * kv_span + torch.arange(kv_span)).flatten()
    _slice_linear(attn.q_proj, rows=q_rows)
    _slice_linear(attn.k_proj, rows=kv_rows)
    _slice_linear(attn.v_proj, rows=kv_rows)
    _slice_linear(attn.o_proj, columns=q_rows)


def _slice_linear(linear: Any, rows: Any = None, columns: Any = None) -> None:
    """Shrink an nn.Linear in place to the given output rows or input columns (bias follows the rows)."""
    import torch

    with torch.no_grad():
        weight = linear.weight if rows is None else linear.weight[rows]
        weight = weight if columns is None else weight[:, columns]
        linear.weight = torch.nn.Parameter(weight.contiguous())
        if linear.bias is not None and rows is not None:
            linear.bias = torch.nn.Parameter(linear.bias[rows].contiguous())
    linear.out_features, linear.in_features = linear.weight.shape


def _update_config(model: Any, neurons: int, groups: int) -> None:
    """Shrink the shared config and set head_dim explicitly: it would otherwise be re-derived from the head count."""
    config = model.config
    ratio = config.num_attention_heads // config.num_key_value_heads
    config.head_dim = model.model.layers[0].self_attn.head_dim
    config.intermediate_size -= neurons
    config.num_key_value_heads -= groups
    config.num_attention_heads -= groups * ratio
    for layer in model.model.layers:
        layer.self_attn.num_key_value_groups = ratio


def _check_structured_arguments(
    config: Any, mlp_fraction: float, head_groups: int, importance: str, calibration: list[list[int]] | None
) -> tuple[int, int]:
    """Validate the request against the config; the number of neurons and KV groups to remove per layer."""
    _check_fraction("mlp_fraction", mlp_fraction)
    neurons = round(mlp_fraction * config.intermediate_size)
    if neurons >= config.intermediate_size:
        raise ValueError(
            f"mlp_fraction: {mlp_fraction} would remove all {config.intermediate_size} MLP neurons"
        )
    kv_heads = config.num_key_value_heads
    if not isinstance(head_groups, int) or not 0 <= head_groups < kv_heads:
        raise ValueError(
            f"head_groups: must be an integer in [0, {kv_heads}) so a KV group remains, got {head_groups!r}"
        )
    heads_left = config.num_attention_heads - head_groups * (config.num_attention_heads // kv_heads)
    if config.hidden_size % heads_left:
        raise ValueError(
            f"head_groups: {head_groups} leaves {heads_left} attention heads, but LlamaConfig requires "
            f"hidden_size ({config.hidden_size}) to be a multiple of num_attention_heads"
        )
    if importance not in ("magnitude", "activation"):
        raise ValueError(f"importance: must be 'magnitude' or 'activation', got {importance!r}")
    if importance == "activation" and not calibration:
        raise ValueError("calibration: importance='activation' needs calibration token sequences, got none")
    return neurons, head_groups


def _check_fraction(name: str, value: float) -> None:
    """Refuse a fraction outside [0, 1): pruning everything leaves no model."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: must be in [0, 1), got {value!r}")


def _zero_fraction(tensors: list[Any]) -> float:
    """Fraction of exactly-zero entries across `tensors`."""
    return sum(int((t == 0).sum()) for t in tensors) / max(1, sum(t.numel() for t in tensors))
