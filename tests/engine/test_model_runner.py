"""The runner's step logits: a mapping of each sampling sequence's row, whose rows in the
step's own order are the logit matrix itself (no copy), in any other order a gather."""

from __future__ import annotations

import torch

from sluice.engine.model_runner import StepLogits


def test_step_logits_map_each_sequence_to_its_row() -> None:
    matrix = torch.arange(12.0).view(3, 4)
    logits = StepLogits([7, 3, 9], matrix)
    assert list(logits) == [7, 3, 9]
    assert len(logits) == 3
    assert logits[3].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert dict(logits).keys() == {7, 3, 9}


def test_rows_in_the_steps_order_are_the_matrix_itself() -> None:
    matrix = torch.randn(3, 5)
    assert StepLogits([7, 3, 9], matrix).rows([7, 3, 9]) is matrix


def test_rows_in_another_order_or_a_subset_are_gathered() -> None:
    matrix = torch.randn(3, 5)
    logits = StepLogits([7, 3, 9], matrix)
    assert torch.equal(logits.rows([9, 7]), matrix[[2, 0]])
    assert torch.equal(logits.rows([3]), matrix[[1]])
