"""The PyTorch engine: transformers eager execution on the CPU or a CUDA GPU (on CPU optionally inside DeepSpeed's
inference engine). The device comes from params.yaml target.device, through `load_runtime`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tasks.config import TargetConfig
from tasks.engines.contract import BatchDecoder, Runtime
from tasks.engines.manifest import VariantManifest
from tasks.engines.pytorch.kv_cache import cache_factory, generation_options, kv_cache_bytes
from tasks.engines.registry import register_engine
from tasks.errors import ArtifactError, EngineError, TargetError
from tasks.weights.catalog import weights_format

ENGINE = "torch"  # the manifest's `engine` for every variant this module runs


@register_engine
class TorchRuntime(Runtime):
    """PyTorch + transformers on `device`. `model` is the loaded transformers model (engine-specific, for tests
    and tools that inspect torch internals; measuring code uses only the Runtime contract)."""

    ENGINE = ENGINE
    LIBRARIES = ("torch", "transformers")

    DEVICES = ("cpu", "cuda")

    def __init__(self, folder: Path, manifest: VariantManifest, target: TargetConfig) -> None:
        """`target.tensor_parallel` > 1: this process is one rank of a split model, on `target.device`
        (tasks/engines/pytorch/tensor_parallel.py)."""
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(target.threads)
        self.manifest = manifest
        settings = manifest.runtime_settings()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        stored = weights_format(manifest.weights_format, folder)
        if target.tensor_parallel > 1 and not stored.splits:
            raise TargetError(f"tensor parallelism splits float weights, not {manifest.weights_format} ones")
        try:
            self.model = stored.load(folder, manifest.dtype, settings, target)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ArtifactError(f"{folder}: cannot load weights ({str(exc).splitlines()[0]})") from exc
        self.device = torch.device(target.device)
        self.model.eval()
        self.context_length = self.model.config.max_position_embeddings
        if settings.wrapper == "deepspeed":
            self.model = deepspeed_engine(self.model, manifest.dtype)
        quantizer = getattr(self.model, "hf_quantizer", None)
        if settings.compile and quantizer is not None and not quantizer.is_compileable:
            raise EngineError(
                f"{folder}: runtime.compile: transformers does not compile {type(quantizer).__name__} models; "
                "set compile: false"
            )
        self.compiled = settings.compile  # callers warm every shape up before timing (a new shape compiles)
        if self.compiled:
            import torch._dynamo.config as dynamo

            # each batch size and static-cache length is one more graph; past torch's default limit of 8 a
            # fullgraph compile raises instead of running
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        self._options = generation_options(settings, self.model.config.head_dim)
        self._new_cache = cache_factory(self._options, self.model.config)  # the server's and sequences' too
        # quanto's packed int4 tensors fail under inference_mode ("Cannot set version_counter"); no_grad works
        no_grad = torch.inference_mode if stored.inference_mode else torch.no_grad
        self._no_grad = inference_context(no_grad, settings.sdpa_backend)
        self._loop = None  # compiled on a GPU: llmopt's own decode loop instead of `generate`
        if self.compiled and self.device.type == "cuda":
            from tasks.engines.pytorch.decode_loop import DecodeLoop, cuda_graph_compiler

            config = self.model.config
            if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
                raise EngineError(  # a windowed static layer counts on the host: a recompile per token
                    f"{folder}: runtime.compile: the compiled loop takes models without windowed attention layers "
                    f"({config.model_type} windows {config.sliding_window} tokens); set compile: false"
                )

            self._loop = DecodeLoop(self.model, self.device, cuda_graph_compiler, self._no_grad)

    @property
    def compile_s(self) -> float | None:
        """Seconds spent compiling the decode loop's steps so far (None: this runtime does not compile)."""
        return None if self._loop is None else sum(self._loop.compile_s.values())

    def score(self, sequences: list[list[int]]) -> list[tuple[float, int]]:
        import torch

        results = []
        with self._no_grad():
            for ids in sequences:
                tensor = torch.tensor([ids], device=self.device)
                logits = self.model(input_ids=tensor).logits[0, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits, tensor[0, 1:], reduction="sum")
                results.append((float(nll), len(ids) - 1))
        return results

    def position_logits(self, ids: list[int]) -> Any:
        return self.logits([ids])[0].numpy()

    def logits(self, sequences: list[list[int]]) -> Any:
        """Float32 logits at every position of equal-length `sequences` (batch × length × vocabulary, on the host):
        for tools that compare a variant's outputs with another's."""
        import torch

        with self._no_grad():
            return self.model(input_ids=torch.tensor(sequences, device=self.device)).logits.float().cpu()

    def suppressed_at_length(self, stop_at_eos: bool) -> frozenset[int]:
        if stop_at_eos:
            return frozenset()
        eos = self.model.generation_config.eos_token_id  # what `min_new_tokens` bars: an id, a list or None
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return frozenset(ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())

    def sequence(self, capacity: int) -> TorchSequence:
        return TorchSequence(self.model, self._no_grad, self.device, self._new_cache)

    def batch_decoder(self) -> BatchDecoder:
        """On a GPU with `runtime.compile: true` a Llama-shaped model's running rows step as one compiled CUDA
        graph per batch bucket (tasks/engines/pytorch/graph_slots.py); otherwise on a GPU the sequences' steps run
        as one padded batch (what GPUs are for). On the CPU a half-precision
        model of a Llama-shaped architecture steps all sequences in one call over fixed KV rows
        (tasks/engines/pytorch/slots.py: its rows match stepping alone to bfloat16 rounding, as the padded batch
        does); fp32 steps each sequence alone, which keeps its results independent of the batch. Also alone: SDPA
        pinned to the flash kernel (it takes no attention mask on CUDA), a sliding window (its cache layer would be
        replaced by a growing one), and speculative variants (stepping alone verifies guesses)."""
        from tasks.engines.pytorch.slots import SlotBatchDecoder, steps_in_slots

        settings = self.manifest.runtime_settings()
        plain = settings.sdpa_backend != "flash" and settings.sliding_window is None and not self._new_cache()
        stepped = plain and settings.speculative is None and steps_in_slots(self.model)
        if self.device.type == "cuda" and stepped and self._loop is not None:
            from tasks.engines.pytorch.decode_loop import cuda_graph_compiler
            from tasks.engines.pytorch.graph_slots import GraphSlotDecoder, graphs_in_slots

            if graphs_in_slots(self.model, settings.sdpa_backend):
                return GraphSlotDecoder(self.model, self._no_grad, self.device, cuda_graph_compiler)
        if self.device.type == "cuda" and plain:
            return PaddedBatchDecoder(self.model, self._no_grad, self.device)
        half = self.manifest.dtype in ("bfloat16", "float16")
        if half and stepped:
            return SlotBatchDecoder(self.model, self._no_grad, self.device)
        return TorchBatchDecoder(self.model, self._no_grad, self.device, self._new_cache)

    def _generate_batch(
        self, batch: list[list[int]], max_new_tokens: int, stop_at_eos: bool
    ) -> list[list[int]]:
        import torch

        if self._loop is not None:
            # every id generate stops on (a list for some models), the ones it bars when running to length
            ends = self.suppressed_at_length(stop_at_eos=False)
            stop, suppressed = (ends, frozenset()) if stop_at_eos else (frozenset(), ends)
            return self._loop.generate(batch, max_new_tokens, suppressed, stop, self._first_tokens)
        extra: dict[str, Any] = {} if stop_at_eos else {"min_new_tokens": max_new_tokens}
        # the time of the first tokens, on the CPU only: on a GPU the host copy of every step's tokens that the
        # streamer gets would add a sync per step
        if self.device.type == "cpu":
            extra["streamer"] = _FirstTokens(self)
        with self._no_grad():
            generated = self.model.generate(
                input_ids=torch.tensor(batch, device=self.device),
                attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long, device=self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.eos_token_id,
                **self._options,
                **extra,
            )
        return generated[:, len(batch[0]) :].tolist()


class _FirstTokens:
    """A transformers streamer that tells the runtime when `generate` has chosen its first tokens (`put` gets the
    prompt first, then each step's tokens)."""

    def __init__(self, runtime: TorchRuntime) -> None:
        self._runtime, self._puts = runtime, 0

    def put(self, value: Any) -> None:
        self._puts += 1
        if self._puts == 2:
            self._runtime._first_tokens()

    def end(self) -> None:
        pass


class TorchSequence:
    """One sequence with transformers' dynamic cache: several tokens per forward call with the logits of each,
    cropped on rewind (speculative decoding)."""

    def __init__(self, model: Any, no_grad: Any, device: Any, new_cache: Any = lambda: None) -> None:
        self._model, self._no_grad, self._device = model, no_grad, device
        self._new_cache = new_cache
        self._cache: Any = new_cache()  # None: transformers' dynamic cache
        self.length = 0
        config = (
            model.config
        )  # a sliding window's cache drops what it would rewind to; a quantized one cannot crop
        windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        self.rewinds = not windowed and self._cache is None

    def extend(self, tokens: list[int], every: bool = True) -> Any:
        import torch

        with self._no_grad():
            out = self._model(
                input_ids=torch.tensor([tokens], device=self._device),
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=0 if every else 1,  # 0: every row
            )
        self._cache, self.length = out.past_key_values, self.length + len(tokens)
        return out.logits[0].float().cpu().numpy()

    def kv_bytes(self) -> int:
        """Bytes the cache holds now (packed quantized tensors by their parts)."""
        return 0 if self._cache is None else kv_cache_bytes(self._cache)

    def rewind(self, length: int) -> None:
        if length < self.length:
            if length == 0:
                self._cache = self._new_cache()
            else:
                self._cache.crop(
                    length - self.length
                )  # negative: tokens to remove (every version reads it so)
            self.length = length


class TorchBatchDecoder(BatchDecoder):
    """Steps each sequence in its own forward call with transformers' default (dynamic) KV cache: padding a
    batch of different lengths can change fp32 results in PyTorch, so sequences share the decoder's turns but
    not its matrix products. A quantized KV cache (`kv_cache: quantized`) is each sequence's cache here too; a static
    one applies to `generate` only."""

    def __init__(self, model: Any, no_grad: Any, device: Any, new_cache: Any = lambda: None) -> None:
        self._model, self._no_grad, self._device = model, no_grad, device
        self._new_cache = new_cache  # a fresh cache per sequence (None: transformers' dynamic one)
        self._caches: dict[int, Any] = {}
        self._next_id = 0

    @property
    def active(self) -> int:
        return len(self._caches)

    def _forward(self, ids: list[int], cache: Any) -> tuple[Any, Any]:
        import torch

        self.steps += 1
        with self._no_grad():
            out = self._model(  # the last row's logits only: an 8 k-token prompt's every row would be 1.6 GB
                input_ids=torch.tensor([ids], device=self._device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values

    def add(self, prompt: list[int]) -> tuple[int, Any]:
        logits, cache = self._forward(prompt, self._new_cache())
        self._next_id += 1
        self._caches[self._next_id] = cache
        return self._next_id, logits

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        if set(tokens) != set(self._caches):
            raise ValueError(f"step needs a token for every active sequence {sorted(self._caches)}")
        logits = {}
        for sequence, token in tokens.items():
            logits[sequence], self._caches[sequence] = self._forward([token], self._caches[sequence])
        return logits

    verifies = True  # a sequence's own dynamic cache takes several tokens, and is cropped on rewind

    def verify(self, sequence: int, tokens: list[int]) -> Any:
        import torch

        if set(self._caches) != {sequence}:
            raise ValueError(f"verify runs sequence {sequence} alone; running: {sorted(self._caches)}")
        self.steps += 1
        with self._no_grad():
            out = self._model(
                input_ids=torch.tensor([tokens], device=self._device),
                past_key_values=self._caches[sequence],
                use_cache=True,
            )
        self._caches[sequence] = out.past_key_values
        return out.logits[0].float().cpu().numpy()

    def rewind(self, sequence: int, length: int) -> None:
        cache = self._caches[sequence]
        if length < cache.get_seq_length():
            cache.crop(length - cache.get_seq_length())  # negative: tokens to remove

    def remove(self, sequence: int) -> None:
        del self._caches[sequence]


class PaddedBatchDecoder(TorchBatchDecoder):
    """Every step runs all sequences in one forward call: each sequence's KV cache is left-padded to the longest,
    with its own attention mask and positions, and split back afterwards. The padding changes only the order of
    floating-point sums, so logits match a sequence stepped alone to float rounding (fp32: ~1e-5 relative; in
    bfloat16 a near-tie can pick another greedy token), not bit for bit. Re-padding copies the caches each step:
    a price that is small beside a GPU's batched matmuls for the server's batch sizes and contexts."""

    def step(self, tokens: dict[int, int]) -> dict[int, Any]:
        import torch
        from transformers import DynamicCache

        if set(tokens) != set(self._caches):
            raise ValueError(f"step needs a token for every active sequence {sorted(self._caches)}")
        order = list(tokens)
        lengths = [self._caches[sequence].get_seq_length() for sequence in order]
        longest = max(lengths)
        batched = DynamicCache()
        for layer in range(len(self._caches[order[0]].layers)):
            keys, values = zip(
                *(_left_padded(self._caches[s].layers[layer], longest) for s in order), strict=True
            )
            batched.update(torch.cat(keys), torch.cat(values), layer)
        mask = torch.zeros(len(order), longest + 1, dtype=torch.long, device=self._device)
        for row, length in enumerate(lengths):
            mask[row, longest - length :] = 1
        self.steps += 1
        with self._no_grad():
            out = self._model(
                input_ids=torch.tensor([[tokens[s]] for s in order], device=self._device),
                attention_mask=mask,
                position_ids=torch.tensor([[length] for length in lengths], device=self._device),
                past_key_values=batched,
                use_cache=True,
            )
        logits = out.logits[:, -1].float().cpu().numpy()
        for row, (sequence, length) in enumerate(zip(order, lengths, strict=True)):
            self._caches[sequence] = _row_cache(out.past_key_values, row, length + 1)
        return {sequence: logits[row] for row, sequence in enumerate(order)}


def _left_padded(layer: Any, length: int) -> tuple[Any, Any]:
    """A one-sequence cache layer's keys and values, zero-padded on the left to `length` positions."""
    import torch.nn.functional as F

    pad = length - layer.keys.shape[2]
    return F.pad(layer.keys, (0, 0, pad, 0)), F.pad(layer.values, (0, 0, pad, 0))


def _row_cache(cache: Any, row: int, length: int) -> Any:
    """One row of a batched cache, its left padding cut, as a cache of its own."""
    from transformers import DynamicCache

    own = DynamicCache()
    for index, layer in enumerate(cache.layers):
        own.update(layer.keys[row : row + 1, :, -length:], layer.values[row : row + 1, :, -length:], index)
    return own


SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def inference_context(no_grad: Any, sdpa_backend: str | None) -> Any:
    """A context manager factory: no gradients, and torch's SDPA pinned to `sdpa_backend` when one is set (a
    kernel that cannot run raises instead of falling back, so the backend recorded is the backend that ran)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if sdpa_backend == "efficient":
        _no_gqa_flag_for_the_efficient_kernel()

    @contextlib.contextmanager
    def context() -> Any:
        pinned = sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[sdpa_backend])) if sdpa_backend else None
        with no_grad(), pinned or contextlib.nullcontext():
            yield

    return context


def _no_gqa_flag_for_the_efficient_kernel() -> None:
    """torch's memory-efficient SDPA kernel takes no `enable_gqa` (torch 2.11 on an H200: "No available kernel" for
    every grouped-query model), which transformers passes whenever there is no mask. While that kernel is the only
    one enabled, transformers is told not to, so it repeats (or, for one query, packs) the key/value heads itself:
    the same attention, computed by the kernel the recipe names. Installed once; other backends are unaffected."""
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.use_gqa_in_sdpa
    if getattr(original, "llmopt_wrapped", False):
        return

    def use_gqa_in_sdpa(*args: Any, **kwargs: Any) -> bool:
        return original(*args, **kwargs) and not only_efficient_sdpa_enabled()

    use_gqa_in_sdpa.llmopt_wrapped = True  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa


def only_efficient_sdpa_enabled() -> bool:
    """Whether torch's SDPA may use the memory-efficient kernel and no other (`sdpa_kernel(EFFICIENT_ATTENTION)`)."""
    from torch.backends import cuda

    others = (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled())
    return cuda.mem_efficient_sdp_enabled() and not any(others)


def deepspeed_engine(model: Any, dtype: str) -> Any:
    """DeepSpeed's inference engine around the model at world size 1 (the target check refuses more ranks on
    CPU; no kernel injection: CPU has no kernels); generate goes through the wrapped module."""
    import os

    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    engine = deepspeed.init_inference(
        model, dtype=getattr(torch, dtype), replace_with_kernel_inject=False, tensor_parallel={"tp_size": 1}
    )
    return engine.module
