"""The floor of gRPC server-streaming with ``grpc.aio``: what a token costs in grpcio itself.

A bare ``grpc.aio`` server on uvloop (the loop ``sluice serve`` runs gRPC on) with the one
RPC the transports benchmark reads, ``sluice.v1.Streams/Generate``, and nothing behind it:
each call takes its tokens from ONE :class:`step_clock.StepClock` (every 20 ms a token for
every live call, ``"<emit_ns> <seq> <due_ns> "``, as ``engine_server.py`` makes them), through
an ``asyncio.Queue`` (a ``grpc.aio`` handler is a coroutine: a token has to wake it), builds
the ``StreamEvent`` and ``await context.write``\\s it. No log, no ids to resume by, no
delivery core. ``bench/transports.py`` measures its CPU per token beside Sluice's
transports: no server written on ``grpc.aio`` can spend less per token on the same machine.

    .venv/bin/python bench/grpc_floor_server.py --port 50070
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import grpc
import uvloop

from sluice.grpc_api import streams_pb2 as pb
from step_clock import StepClock, token_text

__all__ = ["main"]


class _Feed:
    """One call: the clock's step queues its next token."""

    __slots__ = ("count", "queue", "seq")

    def __init__(self, count: int) -> None:
        self.count = count
        self.seq = 0
        self.queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()  # at most count items

    def step(self, due_ns: int) -> bool:
        self.seq += 1
        self.queue.put_nowait((token_text(self.seq, due_ns), self.seq))
        return self.seq < self.count


def _handler(clock: StepClock) -> grpc.GenericRpcHandler:
    async def generate(request: pb.GenerateRequest, context: Any) -> None:
        feed = _Feed(request.max_tokens or 1)
        clock.join(feed)
        try:
            for _ in range(feed.count):
                text, seq = await feed.queue.get()
                event = pb.StreamEvent(
                    id=f"str_floor:{seq}", event="token", token=pb.Token(text=text)
                )
                await context.write(event.SerializeToString())
        finally:
            clock.leave(feed)

    return grpc.method_handlers_generic_handler(
        "sluice.v1.Streams",
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=lambda data: data,
            )
        },
    )


async def _serve(host: str, port: int) -> None:
    clock = StepClock()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handler(clock),))
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"grpc floor on {host}:{port}", flush=True)
    await stop.wait()
    await server.stop(1.0)
    await clock.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
