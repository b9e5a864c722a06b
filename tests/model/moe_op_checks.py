"""Checks every fused MoE op shares, whatever its experts' kind (tests/model/test_moe_fused.py: packed experts on
moe_packed; tests/model/test_moe_dense.py: float, gpt-oss's clamped float and per-channel int8 experts on
moe_dense)."""

from __future__ import annotations

import pytest
import torch

from servescope.model.moe import grouped_experts


def check_moved_weights_rebuild_the_op(experts, move, x, ids, weights) -> None:
    """move(experts) replaces its weight buffers (as the huge-page move or a tensor-parallel shard does): the op is
    built again over the new ones, and still equals grouped_experts."""
    first = experts._fused(x)
    assert first is not None
    move(experts)
    assert experts._fused(x) is not first
    assert torch.equal(experts.grouped(x, ids, weights)[0], grouped_experts(x, ids, weights, experts)[0])


def check_run_refuses_bad_input(op, x, ids, weights) -> None:
    """A built op's run refuses ids of another dtype, rows of another width and weights of another shape, with the
    part named, and changes nothing (the same call with good input still equals the first)."""
    want = op.run(x, ids, weights)[0]
    with pytest.raises(RuntimeError, match="int64"):
        op.run(x, ids.int(), weights)
    with pytest.raises(RuntimeError, match=r"x \[T, H\]"):
        op.run(x[:, :64], ids, weights)
    with pytest.raises(RuntimeError, match="like ids"):
        op.run(x, ids, weights[:, :1])
    assert torch.equal(op.run(x, ids, weights)[0], want)
