"""llama.cpp's side of ``bench/engine_throughput.py --peers llama.cpp``, in ``.peers/llama``.

Run by the bench as ``.peers/llama/bin/python llama_cpp_runner.py JOB.json RESULT.json``
(``protocol.py``). It drives llama.cpp through llama-cpp-python's C bindings, as
``llama-batched-bench`` and ``llama-server`` do, since its high-level ``Llama`` runs one
sequence at a time:

- **all at once**: one context with a KV stream per sequence (``n_seq_max`` = the number of
  prompts, ``kv_unified`` off, ``n_ctx`` = that many times ``max_model_len``); the prompts are
  prefilled in batches of ``n_batch`` tokens (a prompt's first token comes with the batch
  that ends it), then every sequence decodes one token a step, all in one ``llama_decode``;
- **one sequence**: a context of ``max_model_len`` tokens, cleared between prompts (as
  ``Llama.reset()``), each prompt prefilled in one batch and decoded a token at a time.

Greedy is llama.cpp's own greedy sampler (argmax over the logits, in C); EOS is never
checked, so every sequence makes exactly ``output_tokens``. Threads: ``n_threads`` and
``n_threads_batch`` both ``job.threads``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import llama_cpp as llama
from protocol import ForeignCpu, Job, PeerResult, make_phase, run_runner

N_BATCH = 512  # tokens per llama_decode call while prefilling (Llama()'s default n_batch)


@contextmanager
def _context(model: Any, job: Job, num_seqs: int) -> Iterator[Any]:
    params = llama.llama_context_default_params()
    params.n_ctx = num_seqs * job.max_model_len
    params.n_batch = max(N_BATCH, num_seqs)
    params.n_ubatch = N_BATCH
    params.n_seq_max = num_seqs
    params.n_threads = job.threads
    params.n_threads_batch = job.threads
    params.kv_unified = False
    ctx = llama.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    try:
        yield ctx
    finally:
        llama.llama_free(ctx)


class _Batch:
    """A ``llama_batch`` filled from Python: (token, position, sequence, wants logits)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = llama.llama_batch_init(capacity, 0, 1)

    def fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        if len(entries) > self.capacity:
            raise ValueError(f"{len(entries)} tokens in a batch of {self.capacity}")
        raw = self.raw
        raw.n_tokens = len(entries)
        for index, (token, pos, seq, logits) in enumerate(entries):
            raw.token[index] = token
            raw.pos[index] = pos
            raw.n_seq_id[index] = 1
            raw.seq_id[index][0] = seq
            raw.logits[index] = logits

    def free(self) -> None:
        llama.llama_batch_free(self.raw)


def _decode(ctx: Any, batch: _Batch) -> None:
    status = llama.llama_decode(ctx, batch.raw)
    if status != 0:
        raise RuntimeError(f"llama_decode returned {status}")


def _generate(
    ctx: Any, sampler: Any, prompts: list[list[int]], output_tokens: int
) -> tuple[list[list[int]], float, list[float]]:
    """``prompts`` as sequences 0..n-1 of ``ctx``: prefill, then decode all in lockstep."""
    batch = _Batch(max(N_BATCH, len(prompts)))
    completions: list[list[int]] = [[] for _ in prompts]
    ttft = [0.0] * len(prompts)
    try:
        start = time.perf_counter()
        # Prefill: (token, pos, seq, logits) of every prompt token, N_BATCH a call.
        pending = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        for first in range(0, len(pending), N_BATCH):
            chunk = pending[first : first + N_BATCH]
            batch.fill(chunk)
            _decode(ctx, batch)
            for index, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    completions[seq].append(llama.llama_sampler_sample(sampler, ctx, index))
                    ttft[seq] = time.perf_counter() - start
        while len(completions[0]) < output_tokens:
            batch.fill(
                [
                    (tokens[-1], len(prompt) + len(tokens) - 1, seq, True)
                    for seq, (prompt, tokens) in enumerate(zip(prompts, completions, strict=True))
                ]
            )
            _decode(ctx, batch)
            for seq, tokens in enumerate(completions):
                tokens.append(llama.llama_sampler_sample(sampler, ctx, seq))
        return completions, time.perf_counter() - start, ttft
    finally:
        batch.free()


def run(job: Job) -> PeerResult:
    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    model = llama.llama_model_load_from_file(job.model.encode(), params)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed for {job.model}")
    sampler = llama.llama_sampler_init_greedy()
    try:
        with _context(model, job, len(job.prompts)) as ctx:
            _generate(ctx, sampler, job.prompts[:2], 4)  # warm-up
            llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
            foreign = ForeignCpu()
            completions, elapsed, ttft = _generate(ctx, sampler, job.prompts, job.output_tokens)
            batch = make_phase(completions, elapsed, ttft, foreign)
        with _context(model, job, 1) as ctx:
            singles: list[list[int]] = []
            single_ttft: list[float | None] = []
            foreign, start = ForeignCpu(), time.perf_counter()
            for prompt in job.prompts[: job.num_sequential]:
                llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
                (tokens,), _, (first,) = _generate(ctx, sampler, [prompt], job.output_tokens)
                singles.append(tokens)
                single_ttft.append(first)
            one_sequence = make_phase(singles, time.perf_counter() - start, single_ttft, foreign)
        system = llama.llama_print_system_info().decode(errors="replace").strip()
    finally:
        llama.llama_sampler_free(sampler)
        llama.llama_model_free(model)
    return PeerResult(
        engine=f"llama.cpp (llama-cpp-python {llama.__version__})",
        batch=batch,
        one_sequence=one_sequence,
        notes=[
            "all at once: every prompt prefilled in 512-token batches, then all decoded "
            "in lockstep (one KV stream per sequence)",
            f"system: {system}",
        ],
    )


if __name__ == "__main__":
    sys.exit(run_runner(run))
