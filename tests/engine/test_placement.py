"""Which device and dtype ``--device`` / ``--dtype`` give, on machines with and without
CUDA (the rule is pure: the machine's answers are passed in)."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.placement import Placement, PlacementError, machine_placement, resolve_placement

CPU = torch.device("cpu")


def place(device: str, dtype: str, *, gpus: int = 0, bf16: bool = False) -> Placement:
    return resolve_placement(device, dtype, num_cuda_devices=gpus, bf16_supported=bf16)


def test_auto_is_fp32_on_a_machine_without_cuda() -> None:
    assert place("auto", "auto") == Placement(CPU, torch.float32)
    assert place("auto", "auto") == Placement.cpu()


def test_auto_takes_the_first_gpu_in_its_half_precision() -> None:
    assert place("auto", "auto", gpus=2, bf16=True) == Placement(
        torch.device("cuda", 0), torch.bfloat16
    )
    assert place("auto", "auto", gpus=1, bf16=False).dtype is torch.float16
    assert place("cpu", "auto", gpus=1, bf16=True) == Placement(CPU, torch.float32)


def test_a_named_gpu_and_dtype_are_taken_as_given() -> None:
    placement = place("cuda:1", "float32", gpus=2, bf16=True)
    assert placement == Placement(torch.device("cuda", 1), torch.float32)
    assert placement.on_gpu
    assert placement.describe() == "cuda:1 float32"
    assert place("cpu", "bfloat16").describe() == "cpu bfloat16"


@pytest.mark.parametrize(
    ("device", "dtype", "gpus", "bf16", "message"),
    [
        ("cuda", "auto", 0, False, "sees no CUDA device"),
        ("cuda:2", "auto", 2, True, "cuda:0 to cuda:1"),
        ("cuda:x", "auto", 1, True, "expected cuda or cuda:N"),
        ("tpu", "auto", 0, False, "expected auto, cpu, cuda or cuda:N"),
        ("cpu", "float16", 0, False, "not served on the CPU"),
        ("cuda", "bfloat16", 1, False, "does not support it"),
        ("cpu", "float64", 0, False, "expected one of auto, float32"),
    ],
)
def test_what_the_machine_cannot_give_is_refused_with_the_reason(
    device: str, dtype: str, gpus: int, bf16: bool, message: str
) -> None:
    with pytest.raises(PlacementError, match=message):
        place(device, dtype, gpus=gpus, bf16=bf16)


def test_this_machine_answers_for_itself() -> None:
    """The CPU build of this project's torch: auto is the CPU, and CUDA is refused."""
    if torch.cuda.is_available():  # a GPU machine: auto is a GPU
        assert machine_placement("auto", "auto").on_gpu
        return
    assert machine_placement("auto", "auto") == Placement.cpu()
    with pytest.raises(PlacementError, match="use --device cpu"):
        machine_placement("cuda", "auto")
