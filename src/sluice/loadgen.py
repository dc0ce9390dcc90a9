"""``sluice bench``: load an OpenAI-compatible or native Sluice endpoint and report latencies.

Each load level runs either closed loop (``--concurrency C``: C workers, each sending its
next request when the last one ends) or open loop (``--rate R``: Poisson arrivals at R
requests per second, whatever the server's pace). Every request is timed from the moment
it is sent: TTFT to the first token event, one inter-token latency per gap between token
events, and its end. Outcomes are ``ok``, ``refused`` (HTTP 429 or 503 before any body:
the server shed load, Retry-After noted) or ``error`` (any other status, an in-band error
event, a transport error, a timeout). Streams are parsed with Sluice's own SSE decoder.
In closed loop each worker has its own connection, opened before the level's clock
starts, and a refused worker waits what ``Retry-After`` asked (at most a minute, plus up
to a quarter more so refused workers spread out) before its next request, as a
well-behaved client does; ``--ignore-retry-after`` sends again at once.

The native API is two requests: ``POST /v1/streams`` (non-resumable: a benchmark never
reconnects) then ``GET`` of its ``events_url``; TTFT counts both. Figures are reduced and
rendered by :mod:`sluice.loadgen_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import itertools
import math
import random
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx
import orjson

from sluice.errors import ConfigError, SluiceError
from sluice.loadgen_report import (
    LevelReport,
    Outcome,
    Progress,
    RequestResult,
    markdown_table,
    report_document,
    summarize,
    write_plot,
)
from sluice.sse import Decoder, Event

__all__ = [
    "Api",
    "BenchConfig",
    "Load",
    "add_arguments",
    "bench",
    "build_prompt",
    "main",
    "run",
]

# Bounds on what one request may make the client hold or wait for.
MAX_RESPONSE_BYTES = 16 << 20  # a whole SSE response; far above any max_tokens we allow
MAX_SMALL_BODY_BYTES = 64 << 10  # a JSON reply (stream created, error body)
MAX_LINE_BYTES = 1 << 20  # one SSE line: one chunk, however verbose
MAX_REQUESTS_PER_LEVEL = 100_000  # caps --requests, and a --duration level (results kept)
MAX_LEVEL = 4096  # workers, or requests per second
MAX_RETRY_PAUSE_S = 60.0  # the longest a refused worker waits (the openai SDK's bound too)
MAX_RETRY_AFTER_S = 86_400.0  # a larger or unparsable Retry-After is noted as this bound

# The prompt's vocabulary: short common words, so "N words" is near N tokens for GPT-2.
_WORD_TEXT = (
    "the quick brown fox jumps over a lazy dog and then runs into the green forest where "
    "old trees grow tall under a bright blue sky while small birds sing their morning song "
    "to every river stone hill and field that lies beyond the quiet little town"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


class Api(enum.StrEnum):
    OPENAI_CHAT = "openai-chat"
    OPENAI_COMPLETIONS = "openai-completions"
    NATIVE = "native"


class Load(enum.StrEnum):
    CONCURRENCY = "concurrency"  # closed loop
    RATE = "rate"  # open loop, Poisson arrivals


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One ``sluice bench`` run; invalid values raise :class:`~sluice.errors.ConfigError`."""

    base_url: str
    api: Api
    load: Load
    levels: tuple[float, ...]
    num_requests: int | None = 100  # per level; None when bounded by duration_s
    duration_s: float | None = None
    model: str | None = None
    api_key: str | None = None
    max_tokens: int = 64
    prompt_tokens: int = 32
    temperature: float | None = None
    seed: int = 0
    timeout_s: float = 60.0
    max_in_flight: int = 256  # open loop only: arrivals wait for a slot past this
    honor_retry_after: bool = True  # closed loop: a refused worker waits its Retry-After

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://, not {self.base_url!r}")
        if not self.levels or any(not 0 < lv <= MAX_LEVEL for lv in self.levels):
            raise ConfigError(f"each {self.load} level must be within (0, {MAX_LEVEL}]")
        if self.load is Load.CONCURRENCY and any(lv != int(lv) for lv in self.levels):
            raise ConfigError("concurrency levels must be whole numbers")
        if (self.num_requests is None) == (self.duration_s is None):
            raise ConfigError("give exactly one of a request count and a duration per level")
        if self.num_requests is not None and not 1 <= self.num_requests <= MAX_REQUESTS_PER_LEVEL:
            raise ConfigError(f"requests must be within 1..{MAX_REQUESTS_PER_LEVEL}")
        if self.duration_s is not None and not 0 < self.duration_s <= 86_400:
            raise ConfigError("duration must be within (0, 86400] seconds")
        for name, value, low, high in (
            ("max_tokens", self.max_tokens, 1, 1 << 20),
            ("prompt_tokens", self.prompt_tokens, 1, 1 << 20),
            ("max_in_flight", self.max_in_flight, 1, 1 << 16),
        ):
            if not low <= value <= high:
                raise ConfigError(f"{name} must be within {low}..{high}, not {value}")
        if not 0 < self.timeout_s <= 86_400:
            raise ConfigError("timeout must be within (0, 86400] seconds")

    @property
    def endpoint(self) -> str:
        path = {
            Api.OPENAI_CHAT: "/v1/chat/completions",
            Api.OPENAI_COMPLETIONS: "/v1/completions",
            Api.NATIVE: "/v1/streams",
        }[self.api]
        return self.base_url.rstrip("/").removesuffix("/v1") + path

    def settings(self) -> dict[str, object]:
        """The configuration as JSON-ready values, the API key redacted."""
        return {**dataclasses.asdict(self), "api_key": None if self.api_key is None else "***"}


def build_prompt(rng: random.Random, num_words: int) -> str:
    """About ``num_words`` tokens of text, drawn from :data:`WORDS` by ``rng``."""
    return " ".join(rng.choices(WORDS, k=num_words))


class _Failure(Exception):
    """Ends one request early with an outcome other than ok (never escapes this module)."""

    def __init__(
        self,
        outcome: Outcome,
        kind: str,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(kind)
        self.outcome = outcome
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s


class _Timing:
    """Token arrival times of one request, on the monotonic performance clock."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.token_times: list[float] = []
        self.usage_tokens: int | None = None
        self.status: int | None = None

    def token(self) -> None:
        self.token_times.append(time.perf_counter())

    def result(self, outcome: Outcome, failure: _Failure | None = None) -> RequestResult:
        times = self.token_times
        return RequestResult(
            outcome=outcome,
            e2e_s=time.perf_counter() - self.sent,
            ttft_s=times[0] - self.sent if times else None,
            itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
            num_output_tokens=len(times) if self.usage_tokens is None else self.usage_tokens,
            status=self.status if failure is None or failure.status is None else failure.status,
            retry_after_s=None if failure is None else failure.retry_after_s,
            error=failure.kind if failure is not None and outcome is Outcome.ERROR else None,
        )


def _retry_after_s(value: str | None) -> float | None:
    """RFC 9110 §10.2.3: delay-seconds or an HTTP-date, bounded."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return min(float(value[:12]), MAX_RETRY_AFTER_S)
    try:
        delay = parsedate_to_datetime(value).timestamp() - time.time()
    except (TypeError, ValueError):
        return MAX_RETRY_AFTER_S
    return min(max(delay, 0.0), MAX_RETRY_AFTER_S)


async def _read_small(response: httpx.Response) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > MAX_SMALL_BODY_BYTES:
            raise _Failure(Outcome.ERROR, "reply too large", response.status_code)
    return bytes(body)


def _json_object(data: bytes | str) -> dict[str, object]:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _Failure(Outcome.ERROR, "malformed JSON") from None
    if not isinstance(value, dict):
        raise _Failure(Outcome.ERROR, "JSON is not an object")
    return value


def _error_code(payload: dict[str, object]) -> str | None:
    error = payload.get("error", payload)
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


async def _check_status(response: httpx.Response, expected: int) -> None:
    status = response.status_code
    if status == expected:
        return
    if status in (429, 503):
        retry_after_s = _retry_after_s(response.headers.get("retry-after"))
        raise _Failure(Outcome.REFUSED, f"http {status}", status, retry_after_s)
    try:
        code = _error_code(_json_object(await _read_small(response)))
    except _Failure:
        code = None
    raise _Failure(Outcome.ERROR, f"http {status}" + (f" {code}" if code else ""), status)


async def _read_events(response: httpx.Response, handle: Callable[[Event], bool]) -> None:
    """Decode the body and give each event to ``handle`` until it returns True (terminal)."""
    decoder = Decoder(max_line_bytes=MAX_LINE_BYTES, max_event_chars=MAX_RESPONSE_BYTES)
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise _Failure(Outcome.ERROR, "response too large")
        for event in decoder.feed(chunk):
            if handle(event):
                return
    raise _Failure(Outcome.ERROR, "stream ended without a terminal event")


def _sampling(config: BenchConfig) -> dict[str, object]:
    body: dict[str, object] = {"max_tokens": config.max_tokens}
    if config.model is not None:
        body["model"] = config.model
    if config.temperature is not None:
        body["temperature"] = config.temperature
    return body


async def _native(
    client: httpx.AsyncClient, config: BenchConfig, prompt: str, timing: _Timing
) -> None:
    body = {**_sampling(config), "prompt": prompt, "resumable": False}
    async with client.stream("POST", config.endpoint, json=body) as response:
        timing.status = response.status_code
        await _check_status(response, 201)
        events_url = _json_object(await _read_small(response)).get("events_url")
    if not isinstance(events_url, str):
        raise _Failure(Outcome.ERROR, "no events_url")

    def handle(event: Event) -> bool:
        if event.event == "token":
            timing.token()
        elif event.event == "usage":
            tokens = _json_object(event.data).get("completion_tokens")
            timing.usage_tokens = tokens if isinstance(tokens, int) else timing.usage_tokens
        elif event.event == "error":
            code = _error_code(_json_object(event.data)) or "error"
            raise _Failure(Outcome.ERROR, f"in-band {code}")
        elif event.event == "done":
            if _json_object(event.data).get("reason") == "cancelled":
                raise _Failure(Outcome.ERROR, "cancelled")
            return True
        return False

    async with client.stream("GET", httpx.URL(config.endpoint).join(events_url)) as response:
        timing.status = response.status_code
        await _check_status(response, 200)
        await _read_events(response, handle)


async def _openai(
    client: httpx.AsyncClient, config: BenchConfig, prompt: str, timing: _Timing
) -> None:
    chat = config.api is Api.OPENAI_CHAT
    body = {**_sampling(config), "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt

    def handle(event: Event) -> bool:
        if event.data == "[DONE]":
            return True
        chunk = _json_object(event.data)
        if "error" in chunk:
            raise _Failure(Outcome.ERROR, f"in-band {_error_code(chunk) or 'error'}")
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            timing.usage_tokens = usage["completion_tokens"]
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            delta = choice.get("delta") if chat and isinstance(choice, dict) else choice
            text = delta.get("content" if chat else "text") if isinstance(delta, dict) else None
            if isinstance(text, str) and text:
                timing.token()
        return False

    async with client.stream("POST", config.endpoint, json=body) as response:
        timing.status = response.status_code
        await _check_status(response, 200)
        await _read_events(response, handle)


async def _measure(client: httpx.AsyncClient, config: BenchConfig, prompt: str) -> RequestResult:
    """Send one request and time it; every way it can end becomes a result, none raises."""
    timing = _Timing()
    send = _native if config.api is Api.NATIVE else _openai
    try:
        async with asyncio.timeout(config.timeout_s):
            await send(client, config, prompt, timing)
    except _Failure as failure:
        return timing.result(failure.outcome, failure)
    except (TimeoutError, httpx.TimeoutException):
        return timing.result(Outcome.ERROR, _Failure(Outcome.ERROR, "timeout"))
    except httpx.HTTPError as exc:
        return timing.result(Outcome.ERROR, _Failure(Outcome.ERROR, type(exc).__name__))
    except SluiceError as exc:  # the SSE decoder refused the stream
        return timing.result(Outcome.ERROR, _Failure(Outcome.ERROR, type(exc).__name__))
    return timing.result(Outcome.OK)


class _Level:
    """One level's requests: prompts drawn in send order, results kept as they end."""

    def __init__(self, config: BenchConfig, progress: Progress | None) -> None:
        self.config, self.progress = config, progress
        self.results: list[RequestResult] = []
        self._prompts = random.Random(config.seed)
        # One TLS context for all the level's clients: making one costs milliseconds.
        self._tls = ssl.create_default_context()

    def next_prompt(self) -> str:
        return build_prompt(self._prompts, self.config.prompt_tokens)

    def client(self, num_connections: int) -> httpx.AsyncClient:
        """A client with a pool of ``num_connections`` (a fresh one: the caller closes it)."""
        config = self.config
        headers = {} if config.api_key is None else {"Authorization": f"Bearer {config.api_key}"}
        limits = httpx.Limits(
            max_connections=num_connections, max_keepalive_connections=num_connections
        )
        return httpx.AsyncClient(
            limits=limits,
            timeout=httpx.Timeout(config.timeout_s),
            headers=headers,
            verify=self._tls,
            trust_env=False,  # a proxy from the environment would skew every figure
        )

    async def send(self, client: httpx.AsyncClient, prompt: str) -> RequestResult:
        result = await _measure(client, self.config, prompt)
        self.results.append(result)
        if self.progress is not None:
            self.progress.update(result)
        return result


async def _closed_loop(level: _Level, clients: Sequence[httpx.AsyncClient]) -> None:
    """A task per client, each sending its next request as soon as its last one ends;
    a refused one first waits what ``Retry-After`` asked, plus up to a quarter more (jitter,
    so refused workers do not return in step), as a well-behaved client does.

    Each worker has its own client and connection, as separate users would. (One pool
    shared by hundreds of workers costs the client work per request that grows with the
    pool, since httpcore scans its connections: on two cores that delayed requests by
    seconds, which the figures would have blamed on the server.)"""
    config = level.config
    loop = asyncio.get_running_loop()
    deadline = math.inf if config.duration_s is None else loop.time() + config.duration_s
    tickets = iter(range(config.num_requests or MAX_REQUESTS_PER_LEVEL))
    jitter = random.Random(config.seed)

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in tickets:  # shared by all workers: one ticket per request
            if loop.time() >= deadline:
                return
            await send(client)

    async def send(client: httpx.AsyncClient) -> None:
        result = await level.send(client, level.next_prompt())
        pause_s = result.retry_after_s if config.honor_retry_after else None
        if result.outcome is Outcome.REFUSED and pause_s:
            pause_s *= 1 + jitter.random() / 4
            pause_s = min(pause_s, MAX_RETRY_PAUSE_S, deadline - loop.time())
            await asyncio.sleep(pause_s)  # pacing the load as the server asked

    async with asyncio.TaskGroup() as tasks:
        for client in clients:
            tasks.create_task(worker(client))


async def _connect(clients: Sequence[httpx.AsyncClient], config: BenchConfig) -> None:
    """Open each client's connection before the level's clock starts (``GET /v1/models``
    on each, all at once), so that its figures time requests and not a storm of TCP
    set-ups at its start. Nothing here counts: the level's requests report what fails."""
    url = config.base_url.rstrip("/").removesuffix("/v1") + "/v1/models"

    async def connect(client: httpx.AsyncClient) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await client.get(url)

    async with asyncio.TaskGroup() as tasks:
        for client in clients:
            tasks.create_task(connect(client))


async def _open_loop(level: _Level, client: httpx.AsyncClient, rate: float) -> None:
    """Poisson arrivals at ``rate`` per second, each request sent whether or not the
    earlier ones ended; past ``max_in_flight`` open requests, arrivals wait for a slot."""
    config = level.config
    loop = asyncio.get_running_loop()
    arrivals = random.Random(config.seed)
    slots = asyncio.Semaphore(config.max_in_flight)

    async def send(prompt: str) -> None:
        try:
            await level.send(client, prompt)
        finally:
            slots.release()

    start = next_at = loop.time()
    async with asyncio.TaskGroup() as tasks:
        for _ in range(config.num_requests or MAX_REQUESTS_PER_LEVEL):
            if config.duration_s is not None and next_at - start >= config.duration_s:
                break
            await asyncio.sleep(next_at - loop.time())  # pacing the load, not waiting on it
            await slots.acquire()
            tasks.create_task(send(level.next_prompt()))
            next_at += arrivals.expovariate(rate)


def _label(config: BenchConfig, level: float) -> str:
    return f"c={level:g}" if config.load is Load.CONCURRENCY else f"{level:g}/s"


async def bench(config: BenchConfig, progress: Progress | None = None) -> list[LevelReport]:
    """Run every level of ``config`` in turn, each on fresh connections: in closed loop one
    per worker, opened before the level starts; in open loop a pool of ``max_in_flight``."""
    reports = []
    for level_value in config.levels:
        level = _Level(config, progress)
        closed = config.load is Load.CONCURRENCY
        num_clients = int(level_value) if closed else 1
        async with contextlib.AsyncExitStack() as stack:
            size = 1 if closed else config.max_in_flight
            clients = [
                await stack.enter_async_context(level.client(size)) for _ in range(num_clients)
            ]
            if closed:
                await _connect(clients, config)
            if progress is not None:
                progress.start(_label(config, level_value), config.num_requests, config.duration_s)
            started = time.perf_counter()
            try:
                if closed:
                    await _closed_loop(level, clients)
                else:
                    await _open_loop(level, clients[0], level_value)
            finally:
                if progress is not None:
                    progress.finish()
            wall_s = time.perf_counter() - started
        reports.append(summarize(config.load.value, level_value, level.results, wall_s))
    return reports


def _levels(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``sluice bench`` to ``parser``."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server root URL (default: %(default)s)"
    )
    target.add_argument(
        "--api",
        type=Api,
        choices=list(Api),
        default=Api.OPENAI_CHAT,
        help="API to load (default: %(default)s)",
    )
    target.add_argument("--model", help="model name (default: the server's default)")
    target.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="output tokens per request (default: %(default)s)",
    )
    target.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        metavar="N",
        help="prompt length: about N words from a fixed word list (default: %(default)s)",
    )
    target.add_argument(
        "--temperature", type=float, help="sampling temperature (default: not sent)"
    )
    target.add_argument(
        "--seed", type=int, default=0, help="seeds prompts and arrival times (default: %(default)s)"
    )
    load = parser.add_argument_group("load").add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_levels,
        metavar="C,...",
        help="closed loop: C workers sending back to back, per level (default: 1)",
    )
    load.add_argument(
        "--rate", type=_levels, metavar="R,...", help="open loop: Poisson arrivals at R req/s"
    )
    size = parser.add_argument_group("level size").add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, metavar="N", help="requests per level (default 100)")
    size.add_argument("--duration", type=float, metavar="SECONDS", help="seconds per level")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="deadline per request (default: %(default)s)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=256,
        metavar="N",
        help="open loop: most requests open at once; arrivals past it wait (default: %(default)s)",
    )
    parser.add_argument(
        "--ignore-retry-after",
        action="store_true",
        help="closed loop: send again at once after a refusal (default: wait its Retry-After)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    output.add_argument("--plot", type=Path, metavar="PATH.png", help="plot (needs matplotlib)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run ``args`` describe; raises :class:`~sluice.errors.ConfigError` if it cannot work."""
    load = Load.RATE if args.rate is not None else Load.CONCURRENCY
    num_requests = args.requests
    if num_requests is None and args.duration is None:
        num_requests = 100
    return BenchConfig(
        base_url=args.url,
        api=args.api,
        load=load,
        levels=args.rate if load is Load.RATE else (args.concurrency or (1.0,)),
        num_requests=num_requests,
        duration_s=args.duration,
        model=args.model,
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        temperature=args.temperature,
        seed=args.seed,
        timeout_s=args.timeout,
        max_in_flight=args.max_in_flight,
        honor_retry_after=not args.ignore_retry_after,
    )


def run(args: argparse.Namespace) -> int:
    """``sluice bench``: 0 when some request succeeded, 1 when none did, 2 on bad options."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    show_progress = not args.no_progress and sys.stderr.isatty()
    try:
        reports = asyncio.run(bench(config, Progress(sys.stderr) if show_progress else None))
    except KeyboardInterrupt:
        return 130
    print(markdown_table(reports))
    if args.json is not None:
        document = report_document(reports, config.settings())
        try:
            args.json.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
        except OSError as exc:
            print(f"sluice bench: --json {args.json}: {exc}", file=sys.stderr)
            return 1
    if args.plot is not None:
        print(write_plot(reports, args.plot), file=sys.stderr)
    return 0 if any(report.num_ok for report in reports) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice bench",
        description="Load an OpenAI-compatible or native Sluice endpoint; report TTFT, "
        "inter-token latency, throughput, errors and refusals per load level.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
