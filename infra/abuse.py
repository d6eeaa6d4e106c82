"""Flood a running llmopt server with abusive clients while one normal client streams, and say whether the normal
client still gets its answer in time (`make abuse`; exit 1 when it does not).

The abusers, `--clients` of them (64): half open connections and trickle a request's headers, then its body, one
piece a second, never finishing; the other half send prompts as large as the server accepts (just under
serve.max_body_kb, ~1 MiB) back to back. Meanwhile the normal client streams `--max-tokens` tokens of a short prompt
(greedy, ignore_eos) `--repeats` times; its median time is compared with its median time before the flood. The
normal stream must finish within `--limit` (2) times its unloaded time, with no error.

    python infra/abuse.py [--url http://127.0.0.1:8000] [--clients 64] [--max-tokens 64] [--limit 2]

Without --url it reads serve.host, serve.port and serve.max_body_kb from --params (params.yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from urllib.parse import urlsplit

import httpx

PROMPT = "The river walks the stone near the garden, and the market holds the bridge over the winter"


async def normal_stream(client: httpx.AsyncClient, model: str | None, max_tokens: int) -> float:
    """Seconds for one streamed answer of `max_tokens` tokens (an error raises)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"the normal client got {response.status_code}: {(await response.aread())[:200]!r}"
            )
        async for line in response.aiter_lines():
            if '"error"' in line:
                raise RuntimeError(f"the normal client's stream failed: {line[:200]}")
    return time.perf_counter() - started


async def trickler(host: str, port: int, stop: asyncio.Event, counts: dict) -> None:
    """Headers, then a body, one piece a second, never finished; reconnects when the server hangs up."""
    pieces = (
        [
            b"POST /v1/completions HTTP/1.1\r\n",
            f"Host: {host}\r\n".encode(),
            b"Content-Type: application/json\r\n",
            b"Content-Length: 100000\r\n",
            b"X-Slow: 1\r\n",
            b"\r\n",
        ]
        + [b'{"prompt": "']
        + [b"slow " for _ in range(10_000)]
    )
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["refused"] += 1
            await asyncio.sleep(1)
            continue
        counts["connections"] += 1
        try:
            for piece in pieces:
                if stop.is_set() or reader.at_eof():
                    break
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(1)
        except OSError:
            pass  # the server hung up: connect again
        finally:
            writer.close()


async def big_prompts(url: str, headers: dict, size: int, stop: asyncio.Event, counts: dict) -> None:
    """Prompts of `size` characters back to back (each waits for its answer or refusal)."""
    body = {"prompt": "w " * (size // 2), "max_tokens": 16, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        while not stop.is_set():
            try:
                response = await client.post("/v1/completions", json=body)
                counts[f"big {response.status_code}"] = counts.get(f"big {response.status_code}", 0) + 1
            except httpx.HTTPError as exc:
                counts[f"big {type(exc).__name__}"] = counts.get(f"big {type(exc).__name__}", 0) + 1
                await asyncio.sleep(0.2)


async def main(args: argparse.Namespace) -> int:
    if args.url is None:
        from pathlib import Path

        from tasks.params_file import load_config

        serve = load_config(Path(args.params)).serve
        args.url, args.max_body_kb, args.api_key_env = (
            f"http://{serve.host}:{serve.port}",
            serve.max_body_kb,
            serve.api_key_env,
        )
    key = os.environ.get(args.api_key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    parts = urlsplit(args.url)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        health = (await client.get("/health")).json()
        model = health.get("models", [{}])[0].get("id")
        await normal_stream(client, model, 4)  # warm-up
        alone = [await normal_stream(client, model, args.max_tokens) for _ in range(args.repeats)]
        stop, counts = asyncio.Event(), {"connections": 0, "refused": 0}
        size = args.max_body_kb * 1024 - 1024  # the largest prompt the server's body limit lets in
        abusers = [
            asyncio.create_task(trickler(parts.hostname, parts.port or 80, stop, counts))
            for _ in range(args.clients // 2)
        ]
        abusers += [
            asyncio.create_task(big_prompts(args.url, headers, size, stop, counts))
            for _ in range(args.clients - args.clients // 2)
        ]
        await asyncio.sleep(args.settle_s)
        loaded, error = [], None
        try:
            for _ in range(args.repeats):
                loaded.append(
                    await asyncio.wait_for(
                        normal_stream(client, model, args.max_tokens), args.limit * max(alone) * 5 + 30
                    )
                )
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        stop.set()
        for task in abusers:
            task.cancel()
        await asyncio.gather(*abusers, return_exceptions=True)
    base = statistics.median(alone)
    print(f"normal stream of {args.max_tokens} tokens alone: {base:.2f} s (median of {args.repeats})")
    print(
        f"abusers: {args.clients // 2} trickling connections, {args.clients - args.clients // 2} sending "
        f"{size // 1024} KB prompts; what they got: {dict(sorted(counts.items()))}"
    )
    if error:
        print(f"FAILED: the normal client under the flood: {error}")
        return 1
    ratio = statistics.median(loaded) / base
    verdict = "ok" if ratio <= args.limit else "FAILED"
    print(
        f"under the flood: {statistics.median(loaded):.2f} s, {ratio:.2f}x its unloaded time "
        f"(limit {args.limit:g}x): {verdict}"
    )
    return 0 if ratio <= args.limit else 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", default=None, help="the server (default: serve.host and serve.port of --params)"
    )
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument(
        "--clients", type=int, default=64, help="abusive clients (half trickle, half send big prompts)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of the normal client's answer")
    parser.add_argument("--repeats", type=int, default=3, help="normal streams alone and under the flood")
    parser.add_argument("--limit", type=float, default=2.0, help="allowed slowdown of the normal stream")
    parser.add_argument("--max-body-kb", type=int, default=1024, help="the server's serve.max_body_kb")
    parser.add_argument(
        "--settle-s", type=float, default=3.0, help="flood this long before the normal client"
    )
    parser.add_argument("--api-key-env", default="LLMOPT_API_KEY")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
