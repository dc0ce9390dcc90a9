"""Generate the Python code of :file:`streams.proto` (``streams_pb2.py`` and its ``.pyi``).

Run at install time by ``scripts/setup.sh``, or by hand after editing the ``.proto``:
``python -m sluice.grpc_api.build``. The generated files sit beside the ``.proto`` and
are not committed (``.gitignore``): they come from ``grpcio-tools``, never by hand. Only
the messages are generated: the service is registered from :mod:`sluice.grpc_api.service`
with grpc's generic handlers, so no untyped ``_pb2_grpc`` module is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

__all__ = ["PROTO", "build"]

PROTO = Path(__file__).with_name("streams.proto")
_SRC = PROTO.parents[2]  # src/: the proto's import path is sluice/grpc_api/streams.proto


def build() -> None:
    """Run protoc (from ``grpcio-tools``) on :data:`PROTO`; raises on failure."""
    include = Path(grpc_tools.__file__).parent / "_proto"  # the well-known types
    args = [
        "grpc_tools.protoc",
        f"-I{_SRC}",
        f"-I{include}",
        f"--python_out={_SRC}",
        f"--pyi_out={_SRC}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    build()
    sys.exit(0)
