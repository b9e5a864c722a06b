"""The fused MoE op over packed experts (kernels/cpu's moe_packed, csrc/moe_experts.h; PackedExperts.grouped
runs it) against its reference, model/moe.py's grouped_experts over the same modules, bit for bit (the same
kernels and roundings), and against a float64 sum over the dequantised experts: every packed group-32
format, float32 and bfloat16, odd and even token counts, k = 1..8, an expert no token chooses, a local
range of experts (expert parallelism), 1-3 threads. Where it does not apply the reference runs. (Per-channel int8
and float experts: tests/model/test_moe_dense.py.)
(tests/kernels/test_quant_gemv_isas.py runs the same op on every ISA path, torch-free.)"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.packed import QuantLinear, kept_int8, kept_panel
from servescope.model.moe import PackedExperts, grouped_experts
from servescope.quant.packed import dequantize, quantize
from servescope.quant.scheme import QuantScheme

sys.path.insert(0, os.path.dirname(__file__))
from moe_op_checks import check_moved_weights_rebuild_the_op, check_run_refuses_bad_input  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="needs the CPU kernel extension")

H, WIDTH, E, UNUSED = 96, 64, 10, 3  # expert UNUSED: no token chooses it
SCHEMES = {"q4_0": QuantScheme(4), "q4_1": QuantScheme(4, asym=True), "q8_0": QuantScheme(8),
           "int8-g32-asym": QuantScheme(8, asym=True)}


def _experts(scheme: QuantScheme, seed: int = 0) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    gate_up = [QuantLinear(*quantize(torch.randn(2 * WIDTH, H, generator=g) * 0.1, scheme), H) for _ in range(E)]
    down = [QuantLinear(*quantize(torch.randn(H, WIDTH, generator=g) * 0.1, scheme), WIDTH) for _ in range(E)]
    return PackedExperts(gate_up, down)


def _routing(t: int, k: int, dtype, seed: int = 1) -> tuple:
    """x [t, H], ids [t, k] (k distinct experts per token, never UNUSED), weights [t, k] in dtype."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(E) if e != UNUSED])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    weights = (torch.rand(t, k, generator=g) + 0.01).to(dtype)
    return torch.randn(t, H, generator=g).to(dtype), ids, weights


def _exact(experts: PackedExperts, x, ids, weights, first: int = 0, local: int = E) -> torch.Tensor:
    """float64: sum over t's pairs with experts first .. first + local - 1 of w * down(silu(gate) * up)."""
    deq = lambda m: dequantize(*m.plain_weights(), m.in_features, torch.float64)  # noqa: E731
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if first <= e < first + local:
                gate, up = (deq(experts.gate_up[e]) @ x[t].double()).chunk(2)
                out[t] += float(weights[t, j]) * (deq(experts.down[e]) @ (F.silu(gate) * up))
    return out


def _assert_near_exact(out, exact, dtype):
    err = (out.double() - exact).abs().max() / exact.abs().max()
    assert err < (0.05 if dtype == torch.float32 else 0.1), f"relative error {err:.3f}"


def _kept(experts: PackedExperts, scheme: QuantScheme) -> PackedExperts:
    """The experts in the CPU kernels' kept panels (model/quantize.keep_panels), or a skip where none are kept."""
    rows = kept_panel()
    if not rows or (scheme.bits == 8 and not kept_int8()):
        pytest.skip("this CPU's kernels keep no panels for this format")
    assert all(m.keep_panels(rows) for m in experts.linears())
    return experts


@pytest.mark.parametrize("layout", ["rows", "kept"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", SCHEMES)
def test_fused_op_equals_the_grouped_reference(fmt, dtype, layout):
    experts = _experts(SCHEMES[fmt])
    if layout == "kept":
        experts = _kept(experts, SCHEMES[fmt])
    for t in (1, 2, 5, 16, 33):  # 16 and 33 tokens: experts with enough rows for the AMX kernel where it runs
        for k in range(1, 9):
            x, ids, weights = _routing(t, k, dtype, seed=t * 10 + k)
            assert experts._fused(x) is not None
            out, counts = experts.grouped(x, ids, weights)
            ref, ref_counts = grouped_experts(x, ids, weights, experts)
            assert out.dtype == dtype and torch.equal(out, ref), f"{fmt} t={t} k={k}"
            assert torch.equal(counts, ref_counts) and counts[UNUSED] == 0
            if t in (1, 5):
                _assert_near_exact(out, _exact(experts, x, ids, weights), dtype)


def test_float32_routing_weights_with_bfloat16_rows():
    """DeepSeek's router hands float32 weights to bfloat16 experts: rounded as the reference's mul_ rounds."""
    experts = _experts(SCHEMES["q4_0"])
    x, ids, weights = _routing(7, 6, torch.bfloat16)
    assert torch.equal(experts.grouped(x, ids, weights.float() * 1.7)[0],
                       grouped_experts(x, ids, weights.float() * 1.7, experts)[0])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_op_across_threads(threads):
    experts = _experts(SCHEMES["q4_0"], seed=2)
    x, ids, weights = _routing(4, 8, torch.float32)
    ref = grouped_experts(x, ids, weights, experts)[0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(experts.grouped(x, ids, weights)[0], ref)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_op_at_a_wider_shape(dtype):
    """Rows wide and many enough that every loop of the op (gather, quantisation, experts, sum) is split over
    the threads, AMX-sized experts included."""
    g = torch.Generator().manual_seed(5)
    h, width, n = 1024, 512, 16
    gate_up = [QuantLinear(*quantize(torch.randn(2 * width, h, generator=g) * 0.05, SCHEMES["q4_0"]), h)
               for _ in range(n)]
    down = [QuantLinear(*quantize(torch.randn(h, width, generator=g) * 0.05, SCHEMES["q4_0"]), width)
            for _ in range(n)]
    experts = PackedExperts(gate_up, down)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for t in (1, 16, 64):
            x = torch.randn(t, h, generator=g).to(dtype)
            ids = torch.stack([torch.randperm(n, generator=g)[:4] for _ in range(t)])
            weights = torch.rand(t, 4, generator=g).to(dtype)
            assert torch.equal(experts.grouped(x, ids, weights)[0], grouped_experts(x, ids, weights, experts)[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_local_range_of_experts(dtype):
    """Experts 4..7 only (an expert-parallel rank's): pairs routed elsewhere are skipped; the reference is
    grouped_experts over those four and a fifth, last in expert order, that takes the other pairs at weight 0
    (so the four's row counts, and with them their kernels, stay as they are)."""
    experts = _experts(SCHEMES["q8_0"], seed=3)
    first, local = 4, 4
    op = cpu_ops.moe_packed([(m.qweight, m.scales) for m in experts.gate_up[first:first + local]],
                            [(m.qweight, m.scales) for m in experts.down[first:first + local]], first)
    sub = PackedExperts(list(experts.gate_up[first:first + local + 1]), list(experts.down[first:first + local + 1]))
    for t, k in ((1, 8), (6, 3), (9, 8)):
        x, ids, weights = _routing(t, k, dtype, seed=t)
        out, counts = op.run(x, ids, weights)
        inside = (ids >= first) & (ids < first + local)
        ref = grouped_experts(x, torch.where(inside, ids - first, local), torch.where(inside, weights, 0), sub)[0]
        assert torch.equal(out, ref)
        assert counts.tolist() == [int((ids == first + e).sum()) for e in range(local)]
        _assert_near_exact(out, _exact(experts, x, ids, weights, first, local), dtype)


def test_where_the_op_does_not_apply_the_reference_runs():
    x, ids, weights = _routing(5, 2, torch.float32)
    g64 = _experts(QuantScheme(4, group=64))  # not group 32
    assert g64._fused(x) is None
    assert torch.equal(g64.grouped(x, ids, weights)[0], grouped_experts(x, ids, weights, g64)[0])
    experts = _experts(SCHEMES["q4_0"])
    for m in experts.linears():
        m.gemv_rows = 4  # more tokens than the packed GEMV's row limit: a prefill chunk's GEMMs
    assert experts._fused(x) is None and experts._fused(x[:4]) is not None
    experts.fused = False
    assert experts._fused(x[:4]) is None


def test_moved_weights_rebuild_the_op():
    """The huge-page move replaces the packed buffers: the op is rebuilt over the new ones."""
    def move(experts):
        for m in experts.linears():
            m.qweight = m.qweight.clone()

    check_moved_weights_rebuild_the_op(_experts(SCHEMES["q4_0"]), move, *_routing(3, 4, torch.float32))


def test_bad_input_is_refused():
    a, b = _experts(SCHEMES["q4_0"]), _experts(SCHEMES["q8_0"])
    pairs = lambda ms: [(m.qweight, m.scales) for m in ms]  # noqa: E731
    with pytest.raises(RuntimeError, match="one format"):
        cpu_ops.moe_packed(pairs(a.gate_up[:2]) + pairs(b.gate_up[:1]), pairs(a.down[:3]))
    with pytest.raises(RuntimeError, match="as many"):
        cpu_ops.moe_packed(pairs(a.gate_up[:2]), pairs(a.down[:3]))
    with pytest.raises(RuntimeError, match=r"\[2I, H\]"):
        cpu_ops.moe_packed(pairs(a.down[:2]), pairs(a.down[:2]))
    check_run_refuses_bad_input(cpu_ops.moe_packed(pairs(a.gate_up), pairs(a.down)), *_routing(2, 2, torch.float32))
