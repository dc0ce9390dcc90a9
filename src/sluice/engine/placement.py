"""Where a served model runs and in which precision: ``--device`` and ``--dtype``.

:func:`resolve_placement` turns the two flags into a :class:`Placement`, from what this
machine's torch can do (asked by the caller, so the rule is tested on any machine):

============  =================================================================
``--device``  meaning
============  =================================================================
``auto``      the first CUDA device when torch sees one, else the CPU (the default)
``cpu``       the CPU
``cuda``      the first CUDA device; ``cuda:N`` the N-th. An error when torch has no
              CUDA (a CPU build, or no driver) or no such device
============  =================================================================

============  =================================================================
``--dtype``   meaning
============  =================================================================
``auto``      float32 on the CPU (greedy output equal to ``transformers`` in fp32);
              on a GPU bfloat16 where it is supported, else float16 (the default)
``float32``   the weights, activations and KV cache in fp32 (``bfloat16``,
              ``float16`` likewise); logits are sampled in fp32 whatever the dtype
============  =================================================================

Weights are read in fp32 and cast once, at load; the KV cache follows the weights (see
``make_kv_cache``). float16 on the CPU is refused: most CPU kernels are missing or slow in
it, and bfloat16 is the CPU's half precision.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Final

import torch

__all__ = [
    "DEVICE_CHOICES",
    "DTYPE_CHOICES",
    "Placement",
    "PlacementError",
    "add_placement_arguments",
    "machine_placement",
    "resolve_placement",
]

DEVICE_CHOICES: Final = ("auto", "cpu", "cuda")  # and cuda:N
DTYPE_CHOICES: Final = ("auto", "float32", "bfloat16", "float16")
_DTYPES: Final = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class PlacementError(ValueError):
    """A device or dtype this machine cannot give; the message says why."""


@dataclass(frozen=True, slots=True)
class Placement:
    """The device a model's weights and KV cache live on, and their dtype."""

    device: torch.device
    dtype: torch.dtype

    @classmethod
    def cpu(cls) -> Placement:
        """fp32 on the CPU: what the tests and ``transformers`` conformance use."""
        return cls(torch.device("cpu"), torch.float32)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        """For the startup line, e.g. ``cuda:0 bfloat16``."""
        return f"{self.device} {str(self.dtype).removeprefix('torch.')}"


def resolve_placement(
    device: str,
    dtype: str,
    *,
    num_cuda_devices: int,
    bf16_supported: bool,
) -> Placement:
    """The placement ``--device device --dtype dtype`` asks for, on a machine where torch
    sees ``num_cuda_devices`` CUDA devices (bfloat16 supported on them or not); raises
    :class:`PlacementError` for one it cannot give."""
    if device == "auto":
        device = "cuda" if num_cuda_devices > 0 else "cpu"
    if device == "cpu":
        where = torch.device("cpu")
    elif device == "cuda" or device.startswith("cuda:"):
        index_text = device.removeprefix("cuda").removeprefix(":") or "0"
        if not index_text.isdigit():
            raise PlacementError(f"--device {device!r}: expected cuda or cuda:N")
        if num_cuda_devices == 0:
            raise PlacementError(
                f"--device {device}: this torch ({torch.__version__}) sees no CUDA device "
                "(a CPU build, or no NVIDIA driver); use --device cpu"
            )
        index = int(index_text)
        if index >= num_cuda_devices:
            raise PlacementError(
                f"--device {device}: there are {num_cuda_devices} CUDA device(s), "
                f"cuda:0 to cuda:{num_cuda_devices - 1}"
            )
        where = torch.device("cuda", index)
    else:
        raise PlacementError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if dtype == "auto":
        if where.type == "cpu":
            return Placement(where, torch.float32)
        return Placement(where, torch.bfloat16 if bf16_supported else torch.float16)
    chosen = _DTYPES.get(dtype)
    if chosen is None:
        raise PlacementError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    if where.type == "cpu" and chosen is torch.float16:
        raise PlacementError("--dtype float16 is not served on the CPU; use bfloat16 or float32")
    if where.type == "cuda" and chosen is torch.bfloat16 and not bf16_supported:
        raise PlacementError(f"--dtype bfloat16: {where} does not support it; use float16")
    return Placement(where, chosen)


def machine_placement(device: str, dtype: str) -> Placement:
    """:func:`resolve_placement` for this machine's torch."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    bf16 = bool(cuda and torch.cuda.is_bf16_supported())
    return resolve_placement(device, dtype, num_cuda_devices=count, bf16_supported=bf16)


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` (see the module) on ``parser``."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="where the engine runs: auto (a CUDA GPU when torch sees one, else the CPU), "
        "cpu, cuda or cuda:N (default auto)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the engine's weights and KV cache: auto (float32 on the CPU, bfloat16 or "
        "float16 on a GPU), float32, bfloat16 or float16 (default auto)",
    )
