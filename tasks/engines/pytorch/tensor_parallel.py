"""Tensor parallelism for the torch engine: the model split over `ranks` processes by transformers
(`from_pretrained(..., distributed_config=DistributedConfig(tp_size=ranks))`), launched by llmopt itself.

Rank 0 is the calling process: evaluation, benchmark and serving use it like any Runtime. Ranks 1…N−1 are worker
processes llmopt spawns; each loads its shard and then runs, in lockstep, every engine call rank 0 makes (rank 0
broadcasts the call and its arguments, every rank runs it on its shard, rank 0 returns its own result: the
collectives inside the model's forward need all ranks to take part). On CUDA each rank has its own GPU
(`cuda:rank`, NCCL); on a CPU the ranks use gloo, which is how the tests check it (there it only divides the same
cores). One tensor-parallel model per process at a time: torch.distributed has one default group.

transformers 5 chose over DeepSpeed AutoTP: it needs no new package (DeepSpeed's AutoTP crashed at 2 CPU ranks
here, see docs/configuration.md), and its sharded model is the same transformers model the torch engine already
drives, so scoring, generation and stepping are the torch engine's own code on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import socket
import weakref
from pathlib import Path
from typing import Any

from tasks.config import TargetConfig
from tasks.engines.contract import BatchDecoder
from tasks.engines.manifest import VariantManifest
from tasks.engines.pytorch.runtime import TorchRuntime
from tasks.errors import EngineError, TargetError
from tasks.weights.catalog import weights_format

CLOSE = "close"  # the call that ends a worker rank


class TensorParallelRuntime(TorchRuntime):
    """The torch engine over `ranks` processes; this object is rank 0 and forwards every call to the others."""

    def __init__(self, folder: Path, manifest: VariantManifest, target: TargetConfig) -> None:
        import torch.distributed as dist

        ranks = target.tensor_parallel

        if dist.is_initialized():
            raise EngineError(
                "target.tensor_parallel: this process already holds a tensor-parallel model (one at a time)"
            )
        if not weights_format(manifest.weights_format, folder).splits:
            raise TargetError(
                f"{folder}: tensor parallelism splits float weights, not {manifest.weights_format} ones"
            )
        address = f"tcp://127.0.0.1:{_free_port()}"
        spawn = multiprocessing.get_context("spawn")
        self._workers = [
            spawn.Process(
                target=_serve_rank,
                args=(rank, address, str(folder), manifest, target),
                daemon=True,
            )
            for rank in range(1, ranks)
        ]
        for worker in self._workers:
            worker.start()
        self._closer = weakref.finalize(self, _stop, self._workers)
        try:
            _join_group(0, ranks, address, target.device)
            super().__init__(folder, manifest, _on_rank(target, 0))
        except BaseException:
            self._closer()
            raise
        self.ranks = ranks
        self._decoders: dict[int, Any] = {}  # rank 0's own decoders, by number

    def _everywhere(self, name: str, *args: Any) -> Any:
        """Run `name(*args)` on every rank (rank 0 last to start, so all meet in the model's collectives)."""
        import torch.distributed as dist

        dist.broadcast_object_list([(name, args)], src=0)
        return _local_call(self, self._decoders, name, args)

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        return self._everywhere("score", sequences)

    def logits(self, sequences: list[list[int]]) -> Any:
        return self._everywhere("logits", sequences)

    def _generate_batch(
        self, batch: list[list[int]], max_new_tokens: int, stop_at_eos: bool
    ) -> list[list[int]]:
        return self._everywhere("_generate_batch", batch, max_new_tokens, stop_at_eos)

    def batch_decoder(self) -> BatchDecoder:
        return CollectiveDecoder(self, len(self._decoders) + 1)

    def close(self) -> None:
        """Stop the other ranks and leave the process group (also done when this object is collected)."""
        self._closer()


class CollectiveDecoder(BatchDecoder):
    """A batch decoder on every rank: rank 0's answers, the other ranks' decoders stepping alongside."""

    def __init__(self, runtime: TensorParallelRuntime, number: int) -> None:
        self._runtime, self._number = runtime, number
        runtime._everywhere("decoder.open", number)

    @property
    def active(self) -> int:
        return self._runtime._everywhere("decoder.active", self._number)

    def add(self, prompt: list[int]) -> tuple[int, Any]:
        self.steps += 1
        return self._runtime._everywhere("decoder.add", self._number, prompt)

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        self.steps += 1
        return self._runtime._everywhere("decoder.step", self._number, tokens)

    def remove(self, sequence: int) -> None:
        self._runtime._everywhere("decoder.remove", self._number, sequence)


def _local_call(runtime: TorchRuntime, decoders: dict[int, Any], name: str, args: tuple) -> Any:
    """One forwarded call on this rank's shard (`decoder.<method>`: on this rank's decoder `args[0]`)."""
    if not name.startswith("decoder."):
        return getattr(TorchRuntime, name)(runtime, *args)
    number, rest = args[0], args[1:]
    method = name.removeprefix("decoder.")
    if method == "open":
        decoders[number] = TorchRuntime.batch_decoder(runtime)
        return None
    if method == "active":
        return decoders[number].active
    return getattr(decoders[number], method)(*rest)


def _on_rank(target: TargetConfig, rank: int) -> TargetConfig:
    """The target as one rank sees it: its own GPU on a cuda target."""
    return target.model_copy(update={"device": _rank_device(target.device, rank)})


def _serve_rank(
    rank: int, address: str, folder: str, manifest: VariantManifest, target: TargetConfig
) -> None:
    """A worker rank: load its shard, then run every call rank 0 broadcasts until it says close."""
    import torch.distributed as dist

    from tasks.quiet import quiet_libraries

    quiet_libraries()
    _join_group(rank, target.tensor_parallel, address, target.device)
    runtime = TorchRuntime(Path(folder), manifest, _on_rank(target, rank))
    decoders: dict[int, Any] = {}
    while True:
        call: list[Any] = [None]
        dist.broadcast_object_list(call, src=0)
        name, args = call[0]
        if name == CLOSE:
            break
        _local_call(runtime, decoders, name, args)
    dist.destroy_process_group()


def _join_group(rank: int, ranks: int, address: str, device: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    # transformers' tensor-parallel loader reads the rank from the environment
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks)})
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=address,
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(
            minutes=10
        ),  # a rank that died leaves the others waiting no longer than this
    )


def _rank_device(device: str, rank: int) -> str:
    """Each rank's device: its own GPU (cuda:rank) on a cuda target, the CPU otherwise."""
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def _stop(workers: list[Any]) -> None:
    """Tell the other ranks to stop, wait for them (a rank that does not stop is terminated), leave the group."""
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):  # a rank already gone: terminated below
            dist.broadcast_object_list([(CLOSE, ())], src=0)
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.terminate()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
