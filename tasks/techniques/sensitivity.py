"""Sensitivity measurements for the mixed-precision search (tasks/techniques/mixed_precision.py): the empirical
Fisher diagonal that predicts each matrix's loss cost, and the cached layer inputs that measure a decoder layer's
saving by running only the layers from it on."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


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


def fisher_diagonal(
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
