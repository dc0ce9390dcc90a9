"""vLLM CPU's side of ``bench/engine_throughput.py --peers vllm``, in ``.peers/vllm``.

Run by the bench as ``.peers/vllm/bin/python vllm_runner.py JOB.json RESULT.json``
(``protocol.py``), with ``VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>`` (that many OpenMP
threads, bound; vLLM's default reserves a core for its scheduler and runs one thread on 2
cores) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) set by the bench. The offline ``LLM`` as
measured in ``../shared/reports/engine_peers.md``: fp32, ``max_num_seqs`` = the number of
prompts, prefix caching off (the warm-up and the one-at-a-time prompts repeat the batch's
prompts, whose prefill it would otherwise skip), torch.compile as by default; prompts given
as token ids, ``temperature=0``, ``ignore_eos``.

- **all at once**: one ``generate`` call over every prompt; TTFT is each request's
  ``first_token_latency`` (from its arrival, in vLLM's request metrics);
- **one sequence**: one ``generate`` call per prompt.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import time
from typing import Any

from protocol import ForeignCpu, Job, PeerResult, make_phase, run_runner


def _ttft(output: Any) -> float | None:
    """The request's time to first token from its arrival, where vLLM's metrics have it."""
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", None)
    if isinstance(latency, int | float) and math.isfinite(latency) and latency > 0:
        return float(latency)
    return None


def run(job: Job) -> PeerResult:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job.model,
        dtype="float32",
        max_model_len=job.max_model_len,
        max_num_seqs=len(job.prompts),
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=False,  # per-request metrics: first_token_latency
    )
    params = SamplingParams(temperature=0, max_tokens=job.output_tokens, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job.prompts]
    llm.generate(
        prompts[:2],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )

    foreign, start = ForeignCpu(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    batch = make_phase(
        [list(o.outputs[0].token_ids) for o in outputs],
        elapsed,
        [_ttft(o) for o in outputs],
        foreign,
    )

    singles: list[list[int]] = []
    single_ttft: list[float | None] = []
    foreign, start = ForeignCpu(), time.perf_counter()
    for prompt in prompts[: job.num_sequential]:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        singles.append(list(output.outputs[0].token_ids))
        single_ttft.append(_ttft(output))
    one_sequence = make_phase(singles, time.perf_counter() - start, single_ttft, foreign)

    notes = ["fp32, prefix caching off, torch.compile (vLLM's default)"]
    if batch.ttft_p50_s is None:
        notes.append("no per-request metrics: TTFT not measured")
    version = importlib.metadata.version("vllm-cpu")
    return PeerResult(
        engine=f"vLLM CPU (vllm-cpu {version})",
        batch=batch,
        one_sequence=one_sequence,
        notes=notes,
    )


if __name__ == "__main__":
    sys.exit(run_runner(run))
