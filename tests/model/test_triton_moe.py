"""The Triton grouped GEMMs of a mixture of experts (kernels/triton/moe.py) against the per-expert torch loop
(model/moe.grouped_experts), on CPU in Triton's interpreter (shapes kept small)."""

import pytest
import torch

from triton_interp import interpreted

(tm,) = interpreted("servescope.kernels.triton.moe")

from servescope.kernels import fused_ops  # noqa: E402
from servescope.model.moe import Experts, grouped_experts  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _experts(e: int, dm: int, width: int, seed: int) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(e, dm, width)
    ex.gate_up_proj.data = torch.randn(e, 2 * width, dm, generator=g) * dm ** -0.5
    ex.down_proj.data = torch.randn(e, dm, width, generator=g) * width ** -0.5
    return ex


@pytest.mark.parametrize("tokens, e, k, dm, width", [
    (1, 8, 2, 64, 32),  # one decode token: two experts read, six never
    (5, 8, 2, 48, 40),  # widths no tile divides
    (37, 16, 4, 64, 32),  # more pairs than one block per expert
    (3, 4, 4, 32, 16),  # k = E: every expert
])
def test_fused_experts_equal_the_per_expert_loop(tokens, e, k, dm, width):
    ex = _experts(e, dm, width, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, dm, generator=g)
    logits = torch.randn(tokens, e, generator=g)
    weights, ids = logits.softmax(-1).topk(k, -1)
    want, want_counts = grouped_experts(x, ids, weights, ex)
    got, counts = tm.fused_experts(x.to(DEV), ids.to(DEV), weights.to(DEV), ex.gate_up_proj.to(DEV),
                                   ex.down_proj.to(DEV), fused_ops.silu_mul)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(counts.cpu(), want_counts)


def test_the_alignment_groups_pairs_by_expert_in_token_order():
    ids = torch.tensor([[3, 0], [0, 2], [3, 0]])  # pairs 0..5: experts 3 0 0 2 3 0
    sorted_ids, block_expert, total, counts = tm.align_by_expert(ids, 5, block_m=4)
    assert counts.tolist() == [3, 0, 1, 2, 0]
    assert int(total) == 12  # three experts' runs of 4
    runs = sorted_ids.view(-1, 4).tolist()
    assert runs[:3] == [[1, 2, 5, 6], [3, 6, 6, 6], [0, 4, 6, 6]]  # 6 = P: padding
    assert block_expert[:3].tolist() == [0, 2, 3]
    assert sorted_ids.numel() == 24  # P + min(P, E) (BM - 1) = 21, rounded up to BM (the active experts: unknown)


def test_no_tokens_give_zeros():
    ex = _experts(4, 32, 16, seed=0)
    out, counts = tm.fused_experts(torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2),
                                   ex.gate_up_proj, ex.down_proj, fused_ops.silu_mul)
    assert out.shape == (0, 32) and counts.tolist() == [0, 0, 0, 0]


def test_the_experts_op_a_gpu_runs_is_the_triton_one():
    """Experts.grouped on a CUDA tensor takes moe_fused.triton_op (its run, here in the interpreter on CPU
    tensors, equals the per-expert loop; the tokens per expert come back on the host), gpt-oss's clamped
    experts none off the CPU (biases and their activation are not in the kernels)."""
    from servescope.model import moe_fused
    from servescope.model.moe import ClampedExperts

    ex = _experts(8, 32, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 32, generator=g)
    weights, ids = torch.randn(6, 8, generator=g).softmax(-1).topk(2, -1)
    got, counts = moe_fused.triton_op(ex).run(x, ids, weights)
    want, want_counts = grouped_experts(x, ids, weights, ex)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counts.device.type == "cpu" and torch.equal(counts, want_counts)
    clamped = ClampedExperts(8, 32, 16, 7.0, 1.7)
    assert clamped._fused(x.to("meta")) is None  # off the CPU no op has their biases and activation
