"""Engine throughput on the bundled model against ``transformers.generate``, in one run.

What it measures (all greedy, EOS ignored so every request makes exactly ``--output``
tokens, the same torch thread count for everyone):

1. ours: the embedded :class:`~sluice.engine.engine.Engine` (continuous batching, paged KV
   cache, chunked prefill), ``--requests`` requests of ``--prompt`` tokens added at once,
   stepped until all finish, with the engine configuration ``sluice serve`` uses. Output
   tokens/s over the whole run, and time to first token (from the moment all were added)
   p50/p99.
2. baseline "HF sequential": ``transformers`` ``generate(do_sample=False)`` on the same
   checkpoint, one request at a time (``--sequential`` of them; tokens/s does not depend
   on how many).
3. baseline "HF static batch": one ``generate`` call over all requests, left-padded.
4. ours, one sequence: the same engine, built once and reused, given the ``--sequential``
   requests one at a time (the figure to put beside HF sequential and llama.cpp).
5. abort-to-free: the engine under its :class:`~sluice.engine.driver.AsyncEngine` driver,
   all requests decoding; ``--aborts`` requests are aborted 0-3 steps apart and the time
   from ``abort()`` to its reply (blocks free) is compared with the step time.

The issue's targets: ours >= 3x HF sequential and >= 1.5x HF static batch; abort-to-free
within one step. The first few greedy completions of ours and HF's are compared too (they
must be equal; a mismatch is listed under "Problems").

    .venv/bin/python bench/engine_throughput.py            # ~1-2 min on 2 vCPUs
    .venv/bin/python bench/engine_throughput.py --quick    # a smoke run
    .venv/bin/python bench/engine_throughput.py --model default   # SmolLM2-135M (GGUF)

``--model`` takes a checkpoint directory, a ``.gguf`` file (``transformers`` loads the same
file with its GGUF support), or ``default`` for the model ``sluice serve`` loads by default.

``--peers vllm,llama.cpp`` adds the engines users would pick instead, in the same run on the
same prompts (token ids) and workload: vLLM CPU and llama.cpp, each in its own venv under
``.peers/`` (``scripts/install_peers.sh``; a peer that is not there is reported as "not
installed", never fatal), each run in its own process by ``bench/engine_peers/``'s runner
for it, on its own copy of the model (``sluice-tiny`` and ``--model default`` only, both
fp32). The report adds each peer's output tokens/s all at once and one sequence at a time,
its TTFT, the issue's targets (ours >= 1.0x vLLM CPU all at once, >= 0.5x llama.cpp one
sequence) and whether its greedy output equals ours (a difference is listed, not a failure).

``--device`` and ``--dtype`` place both engines (ours as ``sluice serve --device --dtype``,
``transformers`` on the same device in the same dtype): on a GPU machine,
``scripts/gpu_check.sh`` runs it in float32 (greedy output must equal ``transformers``'s,
TF32 off) and in bfloat16 (where the two are compared, not required equal: their kernels
round differently). The script imports only the engine (``sluice.engine``) beside torch and
``transformers``, so it runs where those are installed without the server's dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import inspect
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from engine_peers.launcher import (
    PEERS,
    PeerOutcome,
    parse_peer_names,
    peer_by_name,
    run_peer,
    wait_for_quiet,
)
from engine_peers.protocol import ForeignCpu, Job
from engine_peers.report import OursFigures, peer_rows, summary_table
from sluice.engine.default_model import default_model_file
from sluice.engine.driver import AsyncEngine
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import Checkpoint, load_checkpoint
from sluice.engine.placement import (
    DTYPE_CHOICES,
    Placement,
    PlacementError,
    machine_placement,
)
from sluice.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16  # as sluice serve
# sluice.cli.BUNDLED_MODEL, without importing the server (see the module doc).
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "sluice-tiny"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


PROMPT_MODULES = ("argparse", "asyncio", "collections", "json", "logging", "pathlib", "socket")


def make_prompts(checkpoint: Checkpoint, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` different ``length``-token slices of some standard modules' docstrings."""
    docs: list[str] = []
    for name in PROMPT_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            if not attr.startswith("_"):
                docs.append(inspect.getdoc(getattr(module, attr)) or "")
    ids = checkpoint.tokenizer.encode("\n\n".join(d for d in docs if d))
    rng = random.Random(seed)
    return [
        ids[start : start + length]
        for start in (rng.randrange(len(ids) - length) for _ in range(count))
    ]


@dataclass
class Run:
    """One system's run over the same requests."""

    tokens_per_s: float
    elapsed_s: float
    completions: list[list[int]] = field(repr=False)


@dataclass
class OursRun(Run):
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    step_p50_s: float = 0.0


@dataclass
class AbortRun:
    abort_p50_s: float
    abort_max_s: float
    mean_step_s: float
    max_steps_ended_before_reply: int
    blocks_leaked: int


def engine_config(args: argparse.Namespace, n_positions: int) -> EngineConfig:
    return EngineConfig(
        num_blocks=args.kv_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=args.max_running,
        max_num_batched_tokens=args.max_batched_tokens,
        max_waiting=4 * args.max_running,
        max_model_len=min(n_positions, args.kv_blocks * BLOCK_SIZE),
    )


def make_engine(checkpoint: Checkpoint, args: argparse.Namespace) -> Engine:
    return Engine(
        checkpoint.model,
        engine_config(args, checkpoint.config.n_positions),
        eos_token_id=checkpoint.tokenizer.eos_token_id,
        token_bytes=checkpoint.tokenizer.token_bytes,
    )


def run_ours(
    checkpoint: Checkpoint,
    prompts: list[list[int]],
    args: argparse.Namespace,
    engine: Engine | None = None,
) -> OursRun:
    """All ``prompts`` added at once to ``engine`` (a new one by default), stepped to the end."""
    engine = make_engine(checkpoint, args) if engine is None else engine
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    first: dict[int, float] = {}
    step_s: list[float] = []
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        step_s.append(t1 - t0)
        for output in outputs:
            first.setdefault(output.request_id, t1 - start)
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    elapsed = time.perf_counter() - start
    made = sum(len(t) for t in tokens.values())
    ttft = [first[i] for i in ids]
    return OursRun(
        made / elapsed,
        elapsed,
        [tokens[i] for i in ids],
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        step_p50_s=statistics.median(step_s),
    )


def run_ours_one_at_a_time(
    checkpoint: Checkpoint, prompts: list[list[int]], args: argparse.Namespace
) -> Run:
    """``prompts`` one by one through one reused engine (its KV cache is built once)."""
    engine = make_engine(checkpoint, args)
    run_ours(checkpoint, prompts[:1], argparse.Namespace(**{**vars(args), "output": 4}), engine)
    start = time.perf_counter()
    completions = [run_ours(checkpoint, [p], args, engine).completions[0] for p in prompts]
    elapsed = time.perf_counter() - start
    return Run(sum(len(c) for c in completions) / elapsed, elapsed, completions)


def peer_model_key(model: Path) -> str | None:
    """Which of the peers' copies (``launcher.MODEL_KEYS``) ``model`` (resolved) is, if any."""
    if model.resolve() == BUNDLED_MODEL.resolve():
        return "sluice-tiny"
    try:
        default = default_model_file()
    except FileNotFoundError:
        return None
    return "smollm2-135m" if model.resolve() == default.resolve() else None


def run_peers(
    names: list[str], prompts: list[list[int]], args: argparse.Namespace
) -> list[PeerOutcome]:
    """Each named peer on the same prompts and workload, one after another."""
    job = Job(
        model="",  # each peer's own copy (run_peer)
        prompts=prompts,
        output_tokens=args.output,
        num_sequential=args.sequential,
        threads=args.threads,
        max_model_len=args.prompt + args.output,
    )
    key = peer_model_key(args.model)
    outcomes = []
    for name in names:
        peer = peer_by_name(name)
        wait_for_quiet(args.quiet_wait_s, peer.label, log=print)
        outcomes.append(run_peer(peer, job, key, timeout_s=args.peer_timeout_s, log=print))
    return outcomes


def resolve_model(model: Path) -> Path:
    """``default`` is the model ``sluice serve`` loads when told none."""
    if str(model) == "default":
        return default_model_file()
    return model


def load_hf(path: Path, placement: Placement | None = None) -> transformers.PreTrainedModel:
    """``transformers``' model of ``path``, read in fp32, on ``placement`` (default: CPU)."""
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if placement is not None:
        model.to(device=placement.device, dtype=placement.dtype)
    model.generation_config.eos_token_id = None  # every request makes all its tokens
    return model.eval()


def hf_generate(
    model: transformers.PreTrainedModel, prompts: list[list[int]], output: int, pad_id: int
) -> list[list[int]]:
    """One left-padded ``generate`` call over ``prompts``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=output,
            pad_token_id=pad_id,
        )
    return [row[width:].tolist() for row in out]


def run_hf(
    model: transformers.PreTrainedModel,
    prompts: list[list[int]],
    output: int,
    pad_id: int,
    *,
    batched: bool,
) -> Run:
    """All ``prompts`` in one ``generate`` call, or one call per prompt."""
    start = time.perf_counter()
    if batched:
        completions = hf_generate(model, prompts, output, pad_id)
    else:
        completions = [hf_generate(model, [p], output, pad_id)[0] for p in prompts]
    elapsed = time.perf_counter() - start
    return Run(sum(len(c) for c in completions) / elapsed, elapsed, completions)


async def run_aborts(
    checkpoint: Checkpoint, prompts: list[list[int]], args: argparse.Namespace
) -> AbortRun:
    """Abort requests of a busy engine 0-3 steps apart; time each abort's reply."""
    engine = make_engine(checkpoint, args)
    # Room to the model's last position: the aborts take at most 4 steps each, fewer
    # than that room, so every request is still running when its abort comes.
    room = engine.config.max_model_len - max(len(p) for p in prompts)
    if 4 * min(args.aborts, len(prompts)) >= room:
        raise SystemExit(f"--aborts {args.aborts} need {4 * args.aborts} steps; room for {room}")
    params = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
    rng = random.Random(args.seed)
    latencies: list[float] = []
    steps_between: list[int] = []
    async with AsyncEngine(engine) as driver:
        streams = [await driver.add_request(p, params) for p in prompts]
        for stream in streams:
            await anext(stream)  # every request has its first token: all are decoding
        start_steps, start = engine.num_steps, time.perf_counter()
        for stream in rng.sample(streams, min(args.aborts, len(streams))):
            for _ in range(rng.randint(0, 3)):  # 0-3 steps on: moments the engine sets
                await driver.call(lambda e: None)
            steps_sent = engine.num_steps
            t0 = time.perf_counter()
            assert await driver.abort(stream.request_id)
            latencies.append(time.perf_counter() - t0)
            steps_between.append(engine.num_steps - steps_sent)
        step_s = (time.perf_counter() - start) / max(1, engine.num_steps - start_steps)
        for stream in streams:
            await driver.abort(stream.request_id)
        stats = await driver.call(lambda e: e.block_manager_stats())
    return AbortRun(
        percentile(latencies, 50),
        max(latencies),
        step_s,
        max(steps_between),
        stats.num_used_blocks,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="output tokens per request")
    parser.add_argument("--sequential", type=int, default=16, help="requests HF runs one by one")
    parser.add_argument("--aborts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for everyone")
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 requests of 32+32 tokens")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument(
        "--peers",
        default="",
        help=f"comma-separated engines to run too ({', '.join(p.name for p in PEERS)}; "
        "scripts/install_peers.sh installs them); default none",
    )
    parser.add_argument("--peer-timeout-s", type=float, default=1800.0, help="per peer")
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        help="before timing each engine, wait up to this long for the machine's other jobs "
        "to use < 0.25 cores (default: 60 with --peers, else 0)",
    )
    args = parser.parse_args(argv)
    try:
        peer_names = parse_peer_names(args.peers)
    except ValueError as exc:
        parser.error(str(exc))
    if args.quiet_wait_s is None:
        args.quiet_wait_s = 60.0 if peer_names else 0.0
    if args.quick:
        args.requests, args.prompt, args.output, args.sequential, args.aborts = 8, 32, 32, 4, 4
    torch.set_num_threads(args.threads)
    args.model = resolve_model(args.model)

    try:
        placement = machine_placement(args.device, args.dtype)
    except PlacementError as exc:
        parser.error(str(exc))
    if placement.on_gpu:  # fp32 means fp32: no TF32 matrix products on either side
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    exact = placement.dtype is torch.float32  # greedy output must then equal HF's

    checkpoint = load_checkpoint(args.model, placement=placement)
    hf = load_hf(args.model, placement)
    pad_id = checkpoint.tokenizer.eos_token_id or 0
    prompts = make_prompts(checkpoint, args.requests, args.prompt, args.seed)
    print(
        f"model {checkpoint.name}: {args.requests} requests x ({args.prompt} prompt + "
        f"{args.output} output tokens), {args.threads} torch threads, on "
        f"{placement.describe()}",
        flush=True,
    )
    hf_generate(hf, prompts[:2], 4, pad_id)  # warm-up, both sides
    run_ours(checkpoint, prompts[:2], argparse.Namespace(**{**vars(args), "output": 4}))

    foreign: dict[str, float | None] = {}  # other jobs' cores during each run (ForeignCpu)

    def quiet(what: str) -> ForeignCpu:
        if args.quiet_wait_s:
            wait_for_quiet(args.quiet_wait_s, what, log=print)
        return ForeignCpu()

    meter = quiet("ours")
    ours = run_ours(checkpoint, prompts, args)
    foreign["ours"] = meter.cores()
    print(f"ours: {ours.tokens_per_s:.0f} tok/s", flush=True)
    meter = quiet("HF sequential")
    sequential = run_hf(hf, prompts[: args.sequential], args.output, pad_id, batched=False)
    foreign["hf_sequential"] = meter.cores()
    print(f"HF sequential: {sequential.tokens_per_s:.0f} tok/s", flush=True)
    meter = quiet("HF static batch")
    batch = run_hf(hf, prompts, args.output, pad_id, batched=True)
    foreign["hf_batch"] = meter.cores()
    print(f"HF static batch: {batch.tokens_per_s:.0f} tok/s", flush=True)
    meter = quiet("ours, one sequence")
    single = run_ours_one_at_a_time(checkpoint, prompts[: args.sequential], args)
    foreign["ours_one_sequence"] = meter.cores()
    print(f"ours, one sequence: {single.tokens_per_s:.0f} tok/s", flush=True)
    aborts = asyncio.run(run_aborts(checkpoint, prompts, args))
    outcomes = run_peers(peer_names, prompts, args) if peer_names else []

    problems = []
    agreement: list[tuple[str, str, str]] = []
    for name, run in (("HF sequential", sequential), ("HF static batch", batch)):
        same = sum(a == b for a, b in zip(ours.completions, run.completions, strict=False))
        if same < len(run.completions) and exact:
            problems.append(
                f"{name}: {len(run.completions) - same} of {len(run.completions)} greedy "
                "completions differ from ours"
            )
        agreement.append(
            (f"greedy completions equal to {name}", f"{same} of {len(run.completions)}", "")
        )
    if single.completions != sequential.completions and exact:
        problems.append("ours one at a time: greedy completions differ from HF sequential")
    if aborts.blocks_leaked:
        problems.append(f"{aborts.blocks_leaked} KV blocks still used after every abort")

    vs_seq = ours.tokens_per_s / sequential.tokens_per_s
    vs_batch = ours.tokens_per_s / batch.tokens_per_s
    vs_single = single.tokens_per_s / sequential.tokens_per_s
    one_step = aborts.max_steps_ended_before_reply <= 1
    rows = [
        ("output tokens/s, ours", f"{ours.tokens_per_s:.0f}", ""),
        ("output tokens/s, HF sequential", f"{sequential.tokens_per_s:.0f}", ""),
        ("output tokens/s, HF static batch", f"{batch.tokens_per_s:.0f}", ""),
        ("output tokens/s, ours one sequence", f"{single.tokens_per_s:.0f}", ""),
        ("ours one sequence / HF sequential", f"{vs_single:.2f}x", ""),
        ("ours / HF sequential", f"{vs_seq:.2f}x", _verdict(vs_seq >= 3, ">= 3x")),
        ("ours / HF static batch", f"{vs_batch:.2f}x", _verdict(vs_batch >= 1.5, ">= 1.5x")),
        ("TTFT p50 under load (ms)", _ms(ours.ttft_p50_s), ""),
        ("TTFT p99 under load (ms)", _ms(ours.ttft_p99_s), ""),
        ("engine step p50 (ms)", _ms(ours.step_p50_s), ""),
        ("abort to blocks free p50 (ms)", _ms(aborts.abort_p50_s), ""),
        ("abort to blocks free max (ms)", _ms(aborts.abort_max_s), ""),
        ("mean step while aborting (ms)", _ms(aborts.mean_step_s), ""),
        (
            "steps ended between abort and free (max)",
            str(aborts.max_steps_ended_before_reply),
            _verdict(one_step, "<= 1"),
        ),
        *agreement,
    ]
    figures_for_peers = OursFigures(
        batch_tokens_per_s=ours.tokens_per_s,
        one_sequence_tokens_per_s=single.tokens_per_s,
        hf_batch_tokens_per_s=batch.tokens_per_s,
        batch_completions=ours.completions,
        one_sequence_completions=single.completions,
        batch_foreign_cores=foreign["ours"],
        one_sequence_foreign_cores=foreign["ours_one_sequence"],
        hf_batch_foreign_cores=foreign["hf_batch"],
    )
    more_rows, peer_notes = peer_rows(outcomes, figures_for_peers)
    rows += more_rows
    print("\n| metric | value | target |\n|---|---|---|")
    for metric, value, target in rows:
        print(f"| {metric} | {value} | {target} |")
    if outcomes:
        print("\n" + summary_table(outcomes, figures_for_peers, args.requests))
    if peer_notes:
        print("\nPeers:\n" + "\n".join(f"- {n}" for n in peer_notes))
    if problems:
        print("\nProblems:\n" + "\n".join(f"- {p}" for p in problems))
    if args.json:
        figures = {
            name: {k: v for k, v in dataclasses.asdict(run).items() if k != "completions"}
            for name, run in (
                ("ours", ours),
                ("hf_sequential", sequential),
                ("hf_batch", batch),
                ("ours_one_sequence", single),
                ("aborts", aborts),
            )
        }
        peers = {o.peer.name: o.figures() for o in outcomes}
        args.json.write_text(
            json.dumps(
                {**figures, "foreign_cores": foreign, "peers": peers, "problems": problems},
                indent=2,
            )
        )
    return 1 if problems else 0


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def _verdict(ok: bool, target: str) -> str:
    return f"{target}: {'PASS' if ok else 'MISS'}"


if __name__ == "__main__":
    sys.exit(main())
