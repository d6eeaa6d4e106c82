"""distill: train a shallower copy of the model (the student) to imitate the original (the teacher).

Per step, over the batch's real (non-padding) positions t that have a next token:

    loss = alpha * T² * KL(softmax(z_teacher / T) || softmax(z_student / T)) + (1 - alpha) * CE(z_student, x[t+1])

KL is summed over the vocabulary and averaged over positions; T² keeps the soft-target gradients on the same scale
as the hard-label ones whatever the temperature (Hinton et al., 2015). Training stops at `steps` or after
`max_seconds` of this call, whichever comes first, and checkpoints atomically so a later call resumes where it left.
Batches are chosen from (seed, step) alone, so an interrupted-then-resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from tasks.local_files import staged_file
from tasks.schema import Strict
from tasks.techniques.registry import Applied, Row, Technique, register, step_arguments

CHECKPOINT_FILE = "distill-checkpoint.pt"


class DistillStep(Strict):
    """Knowledge distillation into a shallower student (every k-th layer kept), KL on teacher logits + CE."""

    RECORDED_DEFAULTS = frozenset(
        {"steps", "max_seconds", "lr", "temperature", "alpha", "batch_size", "sequence_tokens"}
        | {"checkpoint_every", "seed"}
    )
    keep_every: Annotated[int, Field(ge=2, le=64)] = 2  # keep layers 0, k, 2k, … and the last ...
    layers: Annotated[int, Field(ge=2)] | None = None  # ... or, when set, this many layers evenly spaced
    steps: Annotated[int, Field(ge=1, le=1_000_000)] = 200
    max_seconds: Annotated[float, Field(gt=0)] = 600.0  # wall-clock bound; a later run resumes the checkpoint
    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-4
    temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 2.0
    alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5  # weight of the KL term (1 - alpha on cross-entropy)
    batch_size: Annotated[int, Field(ge=1, le=1024)] = 4
    sequence_tokens: Annotated[int, Field(ge=8, le=8192)] = (
        256  # calibration text cut into sequences this long
    )
    checkpoint_every: Annotated[int, Field(ge=1)] = 25
    seed: int = 0

    @model_validator(mode="after")
    def _one_depth_rule(self) -> DistillStep:
        if "keep_every" in self.model_fields_set and self.layers is not None:
            raise ValueError("set keep_every or layers, not both")
        return self

    def student_depth(self) -> tuple[int | None, int | None]:
        """(keep_every, layers) for `build_student`: exactly one of them is set."""
        return (None, self.layers) if self.layers is not None else (self.keep_every, None)


@register
class Distill(Technique):
    name = "distill"
    settings = DistillStep
    role = "transform"

    def apply(self, model: Any, settings: DistillStep, context: Any) -> Applied:
        from tasks.weights.safetensors import HF_SAFETENSORS

        cfg = settings
        with step_arguments(self.name):
            student = build_student(model, *cfg.student_depth())
        result = distill(
            model,
            student,
            context.sequences(context.tokenizer, cfg.sequence_tokens),
            DistillSettings(**cfg.model_dump(exclude={"keep_every", "layers", "sequence_tokens"})),
            context.checkpoints,
            lambda i, _: context.report("distill", i, cfg.steps),
        )
        for key in ("loss", "kl", "ce"):
            context.history[f"distill_{key}"] = [entry[key] for entry in result.history]
        first, last = result.history[0]["loss"], result.history[-1]["loss"]
        note = (
            f"distilled into {student.config.num_hidden_layers} of {model.config.num_hidden_layers} layers: "
            f"{result.step} steps (stopped by {result.stopped_by}), loss {first:.3f} → {last:.3f}"
        )
        return Applied(student, HF_SAFETENSORS, note)

    def rows(self) -> list[Row]:
        settings = ("keep_every", "steps", "max_seconds", "lr", "temperature", "alpha", "batch_size")
        return [
            Row(
                "`distill`",
                (*settings, "sequence_tokens", "checkpoint_every", "seed"),
                "a student keeping layers 0, k, 2k, … and the last (or `layers` evenly spaced), trained with "
                "α·T²·KL(teacher ∥ student) + (1 − α)·CE on the calibration split; bounded by steps and seconds; "
                "checkpoints atomically beside the variant and **resumes** after an interruption; loss, KL and CE "
                "per step go to the variant's MLflow run",
            )
        ]


@dataclass(frozen=True)
class DistillSettings:
    """How long and how to distill; everything but steps and max_seconds must match to resume a checkpoint."""

    steps: int
    max_seconds: float
    lr: float
    temperature: float
    alpha: float
    batch_size: int
    checkpoint_every: int
    seed: int


@dataclass(frozen=True)
class DistillResult:
    """Where a distillation call ended: the total step count, the per-step losses and why it stopped."""

    step: int
    resumed_from: int
    history: list[dict[str, float]]
    stopped_by: Literal["steps", "max_seconds"]
    checkpoint: Path


def student_layers(count: int, keep_every: int | None = None, layers: int | None = None) -> list[int]:
    """Teacher layers the student keeps: 0, k, 2k, … and the last (it feeds the final norm), or `layers` evenly
    spaced ones from the first to the last."""
    if layers is not None:
        if not 2 <= layers <= count:
            raise ValueError(f"layers: must be between 2 and the teacher's {count}, got {layers}")
        return sorted({round(i * (count - 1) / (layers - 1)) for i in range(layers)})
    if keep_every is None or keep_every < 1:
        raise ValueError(f"keep_every: must be at least 1, got {keep_every}")
    return sorted(set(range(0, count, keep_every)) | {count - 1})


def build_student(teacher: Any, keep_every: int | None = None, layers: int | None = None) -> Any:
    """A copy of `teacher` with only the decoder layers `student_layers` picks."""
    import torch

    kept = student_layers(teacher.config.num_hidden_layers, keep_every, layers)
    student = copy.deepcopy(teacher)
    student.model.layers = torch.nn.ModuleList(student.model.layers[i] for i in kept)
    for new_index, layer in enumerate(student.model.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index  # the KV cache is indexed by position in the stack
    student.config.num_hidden_layers = len(kept)
    if getattr(student.config, "layer_types", None) is not None:
        student.config.layer_types = [student.config.layer_types[i] for i in kept]
    return student


def distill(
    teacher: Any,
    student: Any,
    batches: list[list[int]],
    settings: DistillSettings,
    checkpoint_dir: Path,
    on_step: Callable[[int, dict[str, float]], None] | None,
) -> DistillResult:
    """Train `student` on `batches` (token sequences) against `teacher`, resuming from `checkpoint_dir` if it holds one."""
    import torch

    _check_settings(settings, batches)
    started = time.monotonic()
    optimizer = torch.optim.AdamW(student.parameters(), lr=settings.lr)
    step, history = _resume(student, optimizer, settings, checkpoint_dir)
    resumed_from = step
    teacher.eval()
    student.train()
    while step < settings.steps and time.monotonic() - started < settings.max_seconds:
        ids, mask = (t.to(student.device) for t in pad_batch(batch_for_step(batches, settings, step)))
        losses = distillation_step(teacher, student, optimizer, ids, mask, settings)
        step += 1
        history.append(losses)
        if step % settings.checkpoint_every == 0:
            save_checkpoint(checkpoint_dir, student, optimizer, settings, step, history)
        if on_step is not None:
            on_step(step, losses)
    student.eval()
    path = save_checkpoint(checkpoint_dir, student, optimizer, settings, step, history)
    stopped_by = "steps" if step >= settings.steps else "max_seconds"
    return DistillResult(step, resumed_from, history, stopped_by, path)


def distillation_step(
    teacher: Any, student: Any, optimizer: Any, ids: Any, mask: Any, settings: DistillSettings
) -> dict[str, float]:
    """One AdamW step on the blended KL + CE loss; the three loss values."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]
    student_logits = student(input_ids=ids, attention_mask=mask).logits[:, :-1]
    valid = mask[:, 1:].bool()  # right padding: position t is scored when token t+1 is real
    t = settings.temperature
    kl = F.kl_div(
        F.log_softmax(student_logits[valid] / t, dim=-1),
        F.log_softmax(teacher_logits[valid] / t, dim=-1),
        log_target=True,
        reduction="batchmean",
    )
    ce = F.cross_entropy(student_logits[valid], ids[:, 1:][valid])
    loss = settings.alpha * t * t * kl + (1 - settings.alpha) * ce
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"loss": loss.item(), "kl": kl.item(), "ce": ce.item()}


def batch_for_step(batches: list[list[int]], settings: DistillSettings, step: int) -> list[list[int]]:
    """The sequences of a step: epoch-wise shuffles seeded by (seed, epoch), so any step is reproducible alone."""
    start = step * settings.batch_size
    chosen = []
    for position in range(start, start + settings.batch_size):
        epoch, index = divmod(position, len(batches))
        order = list(range(len(batches)))
        random.Random(settings.seed * 1_000_003 + epoch).shuffle(order)
        chosen.append(batches[order[index]])
    return chosen


def pad_batch(sequences: list[list[int]]) -> tuple[Any, Any]:
    """Right-pad token sequences into (input_ids, attention_mask) tensors; pads are masked out of every loss."""
    import torch

    width = max(len(ids) for ids in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return ids, mask


def save_checkpoint(
    folder: Path,
    student: Any,
    optimizer: Any,
    settings: DistillSettings,
    step: int,
    history: list[dict[str, float]],
) -> Path:
    """Write student, optimizer, step, loss history and RNG state (staged, then renamed into place)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHECKPOINT_FILE
    state = {
        "student": student.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "history": history,
        "rng": torch.get_rng_state(),
        "settings": asdict(settings),
    }
    with staged_file(path) as partial:
        torch.save(state, partial)
    return path


def _resume(
    student: Any, optimizer: Any, settings: DistillSettings, folder: Path
) -> tuple[int, list[dict[str, float]]]:
    """Load the checkpoint in `folder` into student and optimizer (step and history), or seed a fresh run."""
    import torch

    path = folder / CHECKPOINT_FILE
    if not path.exists():
        torch.manual_seed(settings.seed)
        return 0, []
    state = torch.load(path, weights_only=True, map_location="cpu")
    saved = {k: v for k, v in state["settings"].items() if k not in ("steps", "max_seconds")}
    current = {k: v for k, v in asdict(settings).items() if k not in ("steps", "max_seconds")}
    if saved != current:
        raise ValueError(
            f"checkpoint_dir: {path} was written with settings {saved}, not {current}; use a new folder"
        )
    student.load_state_dict(state["student"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["history"]


def _check_settings(settings: DistillSettings, batches: list[list[int]]) -> None:
    """Refuse settings that cannot train: empty data, non-positive counts, alpha outside [0, 1], T <= 0."""
    if not batches or any(len(ids) < 2 for ids in batches):
        raise ValueError("batches: need at least one token sequence, each of at least 2 tokens")
    for name in ("steps", "batch_size", "checkpoint_every"):
        if getattr(settings, name) < 1:
            raise ValueError(f"settings.{name}: must be at least 1, got {getattr(settings, name)}")
    if not 0.0 <= settings.alpha <= 1.0:
        raise ValueError(f"settings.alpha: must be in [0, 1], got {settings.alpha}")
    if settings.temperature <= 0:
        raise ValueError(f"settings.temperature: must be positive, got {settings.temperature}")
