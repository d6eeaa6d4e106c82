"""Prompt slices of the ONNX engine computed in bfloat16 by torch (oneDNN, AMX where the CPU has it), on the
graph's own weights, with their keys and values handed back to the graph's cache.

Why: on a CPU the builder's int4/int8 graph decodes fastest (a step reads few bytes), but its prompts run through
MatMulNBits, which never reaches AMX: ~200-350 GFLOP/s on a Xeon where oneDNN's bfloat16 matmul reaches ~1 300-1 600
(docs/results/2026-12-05-serving.md). Under load prompts are most of a server's work. So the ONNX batch decoder
keeps its steps on the graph and may run long prompt slices here: the same weights (each MatMulNBits dequantized
once, level x scale, rounded to bfloat16), activations and the residual stream in bfloat16 where the graph's
accuracy level 4 rounds activations to int8 per block, each norm computed in float32 as in the graph. Several
prompts' slices share one call (projections and MLP over all their tokens, attention per slice after what its row
holds).

What is read (tasks/engines/onnx/graph_weights.py): the builder's Llama-shaped graph for a CPU; any other graph is
left to ONNX Runtime. `faster_in_bf16` also compares one prompt's last logits and keys/values with ONNX Runtime's
before the path is used, and refuses it beyond `AGREEMENT` of the logits' spread (`KV_AGREEMENT` of the cache's
largest value).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from tasks.engines.contract import free_memory
from tasks.engines.onnx.graph_weights import GraphWeights
from tasks.engines.pytorch.linears import LinearMaps, packed_linear_works

log = logging.getLogger(__name__)
clock = time.perf_counter  # what the probe times both paths with (tests drive their own)

# the most a slice's last logits may differ from the graph's, as a share of their spread (largest - smallest):
# measured 0.4-0.9 % on SmolLM2 int4/int8 graphs and the test model (tests/model/test_onnx_prompts.py)
AGREEMENT = 0.03
# ... and its keys/values from the graph's, as a share of the largest one: measured 4.7 % on SmolLM2 int4 mixed (the
# graph rounds activations to int8); a key at a wrong position, layer or head is off by about its own size
KV_AGREEMENT = 0.15
PROBE_TOKENS = 96  # the prompt `faster_in_bf16` times both paths on: a typical served prompt's length
# ... the best of this many each (the server decides at start, maybe beside other busy processes)
PROBE_ROUNDS = 3


class BfloatPrompts:
    """Prompt slices after what their rows hold, computed in bfloat16 (see the module docstring)."""

    def __init__(self, weights: GraphWeights, names: list[str], dtype: Any = None) -> None:
        """`names`: the cache inputs (`past_key_values.N.key|value`) in the order callers hand caches over."""
        import torch

        self._order = [
            (names.index(f"past_key_values.{n}.key"), names.index(f"past_key_values.{n}.value"))
            for n in range(len(weights.layers))
        ]
        self._inputs = len(names)

        bf16 = self._dtype = dtype or torch.bfloat16  # float32: the exact reference the tests compare with
        self._heads, self._kv_heads, self._scale = weights.heads, weights.kv_heads, weights.scale
        self._epsilon = weights.epsilon
        self._cos, self._sin = weights.cos, weights.sin
        self._head_size = weights.cos.shape[1] * 2
        probe = weights.layers[0].linears["o_proj"].to(torch.bfloat16)
        pack = bf16 == torch.bfloat16 and packed_linear_works(probe)

        def maps(*matrices: Any) -> LinearMaps:
            joined = torch.cat(matrices).to(bf16)
            return LinearMaps([SimpleNamespace(weight=joined, bias=None)], pack)

        self._embedding = weights.embedding.to(bf16)
        self._layers = []
        for layer in weights.layers:
            linears = layer.linears
            self._layers.append(
                (
                    layer.norms,
                    maps(linears["qkv_proj"]),
                    maps(linears["o_proj"]),
                    maps(linears["gate_proj"], linears["up_proj"]),
                    maps(linears["down_proj"]),
                )
            )
        self._final_norm = weights.final_norm
        self._head = maps(weights.lm_head)

    def _norm(self, x: Any, gamma: Any) -> Any:
        """RMSNorm computed in float32 (as the graph's stash type), returned in the path's dtype."""
        import torch.nn.functional as F

        return F.rms_norm(x.float(), gamma.shape, gamma, self._epsilon).to(self._dtype)

    def run(
        self, slices: list[tuple[list[np.ndarray], list[int]]]
    ) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        """For each (its row's cache: per cache input in the order of `names`, [1, kv heads, held, head size]
        float32; its tokens): the logits after its last token and its cache with the slice's keys and values
        appended (float32, the same order)."""
        import torch
        import torch.nn.functional as F

        bf16 = self._dtype
        with torch.inference_mode():
            held = [int(cache[0].shape[2]) for cache, _ in slices]
            sizes = [len(tokens) for _, tokens in slices]
            ids = torch.tensor([t for _, tokens in slices for t in tokens])
            position = torch.tensor([p for h, n in zip(held, sizes, strict=True) for p in range(h, h + n)])
            half = self._cos[position][None]  # [1, tokens, head size / 2]
            cos = torch.cat([half, half], dim=-1).to(bf16)  # both halves turn by the same angle
            half = self._sin[position][None]
            sin = torch.cat([-half, half], dim=-1).to(bf16)  # the first half's partner is subtracted
            hidden = self._embedding[ids]  # [tokens, hidden] bfloat16
            width, size = len(ids), self._head_size
            heads, kv_heads = self._heads, self._kv_heads
            caches: list[list[Any]] = [[None] * self._inputs for _ in slices]
            for at, (norms, qkv, out, gate_up, down) in zip(self._order, self._layers, strict=True):
                mixed = qkv(self._norm(hidden, norms[0]))
                query, key, value = mixed.split([heads * size, kv_heads * size, kv_heads * size], dim=-1)
                query = _rotate(query.view(width, heads, size).transpose(0, 1), cos, sin)
                key = _rotate(key.view(width, kv_heads, size).transpose(0, 1), cos, sin)
                value = value.view(width, kv_heads, size).transpose(0, 1)
                attended = self._attend(query, key, value, slices, at, caches)
                hidden = hidden + out(attended)
                gate, up = gate_up(self._norm(hidden, norms[1])).chunk(2, dim=-1)
                hidden = hidden + down(F.silu(gate) * up)
            last = torch.tensor(np.cumsum(sizes) - 1)
            logits = self._head(self._norm(hidden[last], self._final_norm)).float().numpy()
        return [(logits[index], caches[index]) for index in range(len(slices))]

    def _attend(
        self,
        query: Any,
        key: Any,
        value: Any,
        slices: list[tuple[list[np.ndarray], list[int]]],
        at: tuple[int, int],
        caches: list[list[Any]],
    ) -> Any:
        """One layer's attention, slice by slice after what its row holds (causal from there): query [heads,
        tokens, size], key and value [kv heads, tokens, size] for all slices' tokens side by side; each slice's
        keys and values appended to its row's cache (float32, at the layer's cache inputs `at`) into `caches`.
        The outputs [tokens, heads x size]."""
        import torch
        import torch.nn.functional as F

        at_k, at_v = at
        parts, first = [], 0
        for index, (cache, tokens) in enumerate(slices):
            count, start = len(tokens), int(cache[0].shape[2])
            new_k, new_v = key[:, first : first + count], value[:, first : first + count]
            keys, values = new_k, new_v
            if start:
                keys = torch.cat([torch.from_numpy(cache[at_k][0]).to(self._dtype), new_k], dim=1)
                values = torch.cat([torch.from_numpy(cache[at_v][0]).to(self._dtype), new_v], dim=1)
            caches[index][at_k] = np.concatenate([cache[at_k], new_k.float().numpy()[None]], axis=2)
            caches[index][at_v] = np.concatenate([cache[at_v], new_v.float().numpy()[None]], axis=2)
            seen = torch.ones(count, start + count, dtype=torch.bool).tril(start) if start else None
            attended = F.scaled_dot_product_attention(
                query[None, :, first : first + count],
                keys[None],
                values[None],
                attn_mask=seen,
                is_causal=not start,
                scale=self._scale,
                enable_gqa=True,
            )
            parts.append(attended[0].transpose(0, 1).reshape(count, -1))
            first += count
        return torch.cat(parts)


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding, halves not interleaved: x [heads, tokens, head size]; cos [1, tokens, size] (each angle's
    cosine twice), sin [1, tokens, size] (its sine negated, then as is): (x1 cos - x2 sin, x2 cos + x1 sin)."""
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def faster_in_bf16(
    model_path: Path,
    names: list[str],
    kv_shape: tuple[int, int],
    threads: int,
    run_alone: Callable[[list[int], list[Any]], tuple[Any, list[Any]]],
) -> BfloatPrompts | None:
    """The bfloat16 path for this graph where it is worth having: a CPU with bfloat16 matrix instructions (AMX or
    AVX-512 BF16; elsewhere not even probed), room for the weights' copies, a graph it reads whose cache is
    `kv_shape` ([kv heads, head size]), a probe prompt whose last logits and keys/values agree with ONNX Runtime's
    (`run_alone(tokens, empty cache)`) within `AGREEMENT` and `KV_AGREEMENT`, and that it runs faster here, on
    `threads` threads (best of `PROBE_ROUNDS` each). None otherwise, the verdict in the log; a graph it misreads
    so badly that reading or running it fails is logged and left to ONNX Runtime."""
    if not _bf16_matmul_in_hardware():
        log.info(
            "%s: this CPU has no bfloat16 matrix instructions: prompts stay on ONNX Runtime",
            model_path.parent.name,
        )
        return None
    if free_memory() < 10 * weights_bytes(model_path):  # float32 matrices while reading: ~8x int4's bytes
        log.info("%s: no room for a bfloat16 copy of the weights", model_path.parent.name)
        return None
    import torch

    name = model_path.parent.name
    try:
        weights = GraphWeights.read(model_path)
        if weights is None or (weights.kv_heads, weights.cos.shape[1] * 2) != tuple(kv_shape):
            log.info("%s: not a graph the bfloat16 prompt path reads", name)
            return None
        torch.set_num_threads(
            threads
        )  # as many as ONNX Runtime's sessions (the process's torch calls share it)
        prompts = BfloatPrompts(weights, names)
        empty = [np.zeros((1, *kv_shape[:1], 0, kv_shape[1]), np.float32) for _ in names]
        probe = [(37 * index) % (weights.embedding.shape[0] - 3) + 3 for index in range(PROBE_TOKENS)]
        used, verdict = _verdict(lambda: prompts.run([(empty, probe)])[0], lambda: run_alone(probe, empty))
    except Exception as exc:  # a graph read wrongly: ONNX Runtime runs its prompts, as before
        log.warning("%s: bfloat16 prompts not used: %s: %s", name, type(exc).__name__, exc)
        return None
    log.info("%s: %s", name, verdict)
    return prompts if used else None


def _verdict(ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[bool, str]:
    """Whether the probe's bfloat16 call (`ours`) agrees with ONNX Runtime's (`theirs`), each giving (last logits,
    cache), and beats it (best of `PROBE_ROUNDS` each, interleaved, timed by `clock`); and what was found, in
    words."""
    calls = {"bf16": ours, "onnx": theirs}
    took, found = {}, {}
    for name in [*calls] * PROBE_ROUNDS:
        started = clock()
        found[name] = calls[name]()
        took[name] = min(took.get(name, float("inf")), clock() - started)
    (logits, cache), (graph_logits, graph_cache) = found["bf16"], found["onnx"]
    spread = float(graph_logits.max() - graph_logits.min())
    apart = float(np.abs(logits - graph_logits).max()) / spread if spread else float("inf")
    cache_apart = max(
        float(np.abs(mine - kept).max()) / max(float(np.abs(kept).max()), 1e-12)
        for mine, kept in zip(cache, graph_cache, strict=True)
    )
    if not (apart <= AGREEMENT and cache_apart <= KV_AGREEMENT):
        return False, (
            f"bfloat16 prompts differ from ONNX Runtime's by {apart:.3f} of the logits' spread, their keys/values "
            f"by {cache_apart:.3f} of the largest: not used"
        )
    used = took["bf16"] < took["onnx"]
    return used, (
        f"a {PROBE_TOKENS}-token prompt in bfloat16 {1e3 * took['bf16']:.1f} ms, on ONNX Runtime "
        f"{1e3 * took['onnx']:.1f} ms: bfloat16 prompts {'used' if used else 'not used'}"
    )


def weights_bytes(model_path: Path) -> int:
    """The graph's weights on disk: the file beside it (the builder's `model.onnx.data`), else the graph itself."""
    data = model_path.with_name(model_path.name + ".data")
    return (data if data.exists() else model_path).stat().st_size


def _bf16_matmul_in_hardware() -> bool:
    """Whether the CPU multiplies bfloat16 matrices in hardware (AMX or AVX-512 BF16, from /proc/cpuinfo's flags);
    elsewhere oneDNN emulates bfloat16 and the path cannot pay. True where the flags cannot be read (the probe
    decides there)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "amx_bf16" in flags or "avx512_bf16" in flags
