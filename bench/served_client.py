"""The workload and the client of ``bench/served_throughput.py``: the prompts, and a closed
loop of streamed ``POST /v1/completions`` from aiohttp (as vLLM's ``bench serve`` uses), the
same for every server, Sluice's or a peer's.

A request is greedy, ``ignore_eos``, ``stream_options.include_usage``; its output tokens are
the usage chunk's ``completion_tokens``, or, from a server that sends no usage, the number of
chunks that carried text, so that a server that stops short shows as short.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from tokenizers import Tokenizer

__all__ = ["MODEL", "MODEL_NAME", "PROMPT_TOKENS", "Sample", "closed_loop", "make_prompts"]

MODEL = Path(__file__).resolve().parents[1] / "models" / "sluice-tiny"
MODEL_NAME = "sluice-tiny"  # what every server is asked for in "model"
PROMPT_TOKENS = 128
PROMPT_MODULES = ("argparse", "asyncio", "collections", "json", "logging", "pathlib", "socket")
MAX_REQUEST_S = 600  # a whole streamed request, at most


def make_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` texts that ``sluice-tiny``'s tokenizer encodes as exactly ``length`` tokens:
    slices of some standard modules' docstrings (as ``bench/engine_throughput.py``)."""
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    docs = []
    for name in PROMPT_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        docs += [
            inspect.getdoc(getattr(module, a)) or "" for a in sorted(vars(module)) if a[0] != "_"
        ]
    ids = tokenizer.encode("\n\n".join(d for d in docs if d)).ids
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        start = rng.randrange(len(ids) - length)
        text = tokenizer.decode(ids[start : start + length])
        if len(tokenizer.encode(text).ids) == length:  # re-encodes to the same length
            prompts.append(text)
    return prompts


@dataclass
class Sample:
    """One request at the client."""

    text: str = ""
    ttft_s: float | None = None
    num_tokens: int = 0  # completion_tokens of the usage chunk, else num_chunks
    num_chunks: int = 0  # chunks that carried text
    prompt_tokens: int | None = None  # prompt_tokens of the usage chunk
    error: str = ""


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> Sample:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sample = Sample()
    started = time.perf_counter()
    parts: list[str] = []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                sample.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return sample
            async for line in response.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[5:])
                if chunk.get("error"):
                    sample.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        if sample.ttft_s is None:
                            sample.ttft_s = time.perf_counter() - started
                        parts.append(choice["text"])
                        sample.num_chunks += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    sample.num_tokens = usage["completion_tokens"]
                    sample.prompt_tokens = usage.get("prompt_tokens")
    except (TimeoutError, aiohttp.ClientError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.text = "".join(parts)
    sample.num_tokens = sample.num_tokens or sample.num_chunks
    return sample


async def closed_loop(
    base: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    """Every prompt once, ``concurrency`` at a time; the samples in prompt order, and the
    wall time."""
    url = f"{base}/v1/completions"
    samples: list[Sample] = [Sample() for _ in prompts]
    next_index = iter(range(len(prompts)))
    # A connection per request, for every server: llama-server ends a streamed response
    # without keeping its connection, and a request sent on it fails ("Can not write request
    # body"; ../shared/reports/engine_peers.md saw the same from vLLM's client).
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    timeout = aiohttp.ClientTimeout(total=MAX_REQUEST_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            for index in next_index:
                samples[index] = await one_request(session, url, prompts[index], max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return samples, time.perf_counter() - started
