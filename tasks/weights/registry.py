"""The weights-format contract: a `WeightsFormat` subclass decorated with `@register` saves a torch model into a
variant folder and loads it back on a device. The name is what the variant's manifest records
(`weights_format`), so a stored variant keeps loading as long as its format module is registered.

Adding a format is one module (a subclass and `@register`) and one line in tasks/weights/catalog.py's
`BUILT_IN`, or a plug-in module (tasks/plugins.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from tasks.config import RuntimeSettings, TargetConfig


class WeightsFormat:
    """One way of storing a torch model's weights. Subclasses set `name` and implement `save` and `load`."""

    name: ClassVar[str]  # recorded in the manifest as `weights_format`
    # The engine wraps a forward in torch.inference_mode unless the format's tensors need plain no_grad
    # (optimum-quanto's packed tensors cannot be created under inference mode).
    inference_mode: ClassVar[bool] = True
    splits: ClassVar[bool] = False  # tensor parallelism can shard it (float weights only)
    dtype: ClassVar[str | None] = (
        None  # the dtype it computes in whatever runtime.dtype says (None: that one)
    )

    def save(self, model: Any, dest: Path, dtype: str, record: dict[str, Any] | None) -> None:
        """Write `model` (and its config) into `dest`; `dtype`: the variant's runtime dtype; `record`: what the
        step that produced the model stores beside it (an on-load record), if anything."""
        raise NotImplementedError

    def load(self, folder: Path, dtype: str, settings: RuntimeSettings, target: TargetConfig) -> Any:
        """The model in `folder` on `target.device` (with `target.tensor_parallel` > 1, this rank's shard: the
        process group is already joined), as the runtime `settings` ask."""
        raise NotImplementedError


FORMATS: dict[str, WeightsFormat] = {}


def register(cls: type[WeightsFormat]) -> type[WeightsFormat]:
    """Class decorator: add the format under its name (a second class of the same name is an error)."""
    if cls.name in FORMATS and type(FORMATS[cls.name]) is not cls:
        raise ValueError(f"weights format {cls.name!r} is registered twice")
    FORMATS[cls.name] = cls()
    return cls
