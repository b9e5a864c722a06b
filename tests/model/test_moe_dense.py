"""The fused MoE op over float, gpt-oss's clamped float (biases, clamped SwiGLU), per-channel int8 and gpt-oss's
clamped int8 experts (kernels/cpu's moe_dense, csrc/moe_dense.cpp; Experts.grouped, ClampedExperts.grouped and
PackedExperts.grouped of Int8Linears run it) against its reference, model/moe.py's
grouped_experts over the same modules, bit for bit (each expert's rows on its module's kernel: the GEMV up to
its row limit, ATen's linear above), and against a float64 sum over the experts: float32 and bfloat16, token
counts on both sides of the GEMV's row limits (decode batches and prefill chunks), k = 1..8, an expert no token
chooses, a local range of experts (expert parallelism), 1-3 threads. Where it does not apply the reference runs."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from servescope import LLM
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears.int8 import Int8Linear
from servescope.model.moe_clamped import PackedClampedExperts
from servescope.model.moe_fused import EXPERT_GEMV_ROWS
from servescope.model.moe import ClampedExperts, Experts, PackedExperts, grouped_experts, moe_blocks

sys.path.insert(0, os.path.dirname(__file__))
from moe_op_checks import check_moved_weights_rebuild_the_op, check_run_refuses_bad_input  # noqa: E402
from tiny_models import MOE_FAMILIES, make_tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="needs the CPU kernel extension")

H, WIDTH, E, UNUSED = 96, 40, 10, 3  # expert UNUSED: no token chooses it; widths need not be 32-blocks
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TOKENS = (1, 2, 3, 9, 17, 40)  # experts' rows on both sides of the GEMV's limits (moe_fused, Int8Linear)
LIMIT, ALPHA = 0.3, 1.702  # gpt-oss's alpha; a limit the random activations cross (both clamps bite)


def _float_experts(dtype, seed: int = 0, n: int = E, h: int = H, width: int = WIDTH) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(n, h, width)
    ex.gate_up_proj.data = (torch.randn(n, 2 * width, h, generator=g) * 0.1).to(dtype)
    ex.down_proj.data = (torch.randn(n, h, width, generator=g) * 0.1).to(dtype)
    return ex


def _clamped_experts(dtype, seed: int = 0) -> ClampedExperts:
    """gpt-oss's float experts: _float_experts' weights plus random biases."""
    f = _float_experts(dtype, seed)
    ex = ClampedExperts(E, H, WIDTH, LIMIT, ALPHA)
    g = torch.Generator().manual_seed(seed + 100)
    ex.gate_up_proj.data, ex.down_proj.data = f.gate_up_proj.data, f.down_proj.data
    ex.gate_up_proj_bias.data = (torch.randn(E, 2 * WIDTH, generator=g) * 0.1).to(dtype)
    ex.down_proj_bias.data = (torch.randn(E, H, generator=g) * 0.1).to(dtype)
    return ex


def _int8_experts(dtype, seed: int = 0) -> PackedExperts:
    ex = _float_experts(torch.float32, seed)
    return PackedExperts([Int8Linear(w, None, dtype) for w in ex.gate_up_proj],
                         [Int8Linear(w, None, dtype) for w in ex.down_proj])


def _int8_clamped_experts(dtype, seed: int = 0) -> PackedClampedExperts:
    """gpt-oss's experts under --quantization int8: _clamped_experts' weights as Int8Linears, its biases."""
    c = _clamped_experts(dtype, seed)
    ex = PackedClampedExperts([Int8Linear(w.float(), None, dtype) for w in c.gate_up_proj],
                              [Int8Linear(w.float(), None, dtype) for w in c.down_proj], LIMIT, ALPHA)
    ex.gate_up_proj_bias, ex.down_proj_bias = c.gate_up_proj_bias, c.down_proj_bias
    return ex


def _routing(t: int, k: int, dtype, seed: int = 1) -> tuple:
    """x [t, H], ids [t, k] (k distinct experts per token, never UNUSED), weights [t, k] in dtype."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(E) if e != UNUSED])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    weights = (torch.rand(t, k, generator=g) + 0.01).to(dtype)
    return torch.randn(t, H, generator=g).to(dtype), ids, weights


def _matrices(experts) -> tuple:
    """Each expert's (gate_up, down) as float64, the int8 ones dequantised."""
    if isinstance(experts, Experts):
        return [(experts.gate_up_proj[e].double(), experts.down_proj[e].double()) for e in range(E)]
    deq = lambda m: m.weight_int8.double() * m._scale_f32.double()[:, None]  # noqa: E731
    return [(deq(g), deq(d)) for g, d in zip(experts.gate_up, experts.down)]


def _exact(experts, x, ids, weights) -> torch.Tensor:
    """float64: sum over t's pairs of w * down(act(gate_up x)), with gpt-oss's biases and clamped SwiGLU for
    ClampedExperts and PackedClampedExperts."""
    mats = _matrices(experts)
    clamped = isinstance(experts, (ClampedExperts, PackedClampedExperts))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up, down = mats[e]
            if not clamped:
                gate, up = (gate_up @ x[t].double()).chunk(2)
                out[t] += float(weights[t, j]) * (down @ (F.silu(gate) * up))
                continue
            gate, up = (gate_up @ x[t].double() + experts.gate_up_proj_bias[e].double()).chunk(2)
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            h = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[t] += float(weights[t, j]) * (down @ h + experts.down_proj_bias[e].double())
    return out


def _check(experts, t: int, k: int, dtype, exact: bool = False) -> None:
    x, ids, weights = _routing(t, k, dtype, seed=t * 10 + k)
    assert experts._fused(x) is not None
    out, counts = experts.grouped(x, ids, weights)
    ref, ref_counts = grouped_experts(x, ids, weights, experts)
    assert out.dtype == dtype and torch.equal(out, ref), f"t={t} k={k}"
    assert torch.equal(counts, ref_counts) and counts[UNUSED] == 0
    if exact:
        err = (out.double() - _exact(experts, x, ids, weights)).abs().max()
        scale = _exact(experts, x, ids, weights).abs().max()
        assert err / scale < (1e-5 if dtype == torch.float32 and isinstance(experts, Experts) else 0.05)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_float_experts_equal_the_grouped_reference(dtype):
    experts = _float_experts(dtype)
    for t in TOKENS:
        for k in (1, 2, 5, 8):
            _check(experts, t, k, dtype, exact=k == 2)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_clamped_experts_equal_the_grouped_reference(dtype):
    """gpt-oss's float experts: each bias added after its projection's rounding to the activation dtype, the
    clamped SwiGLU on the kernel ClampedExperts.hidden calls, the same bits as ClampedExperts.run expert by
    expert."""
    experts = _clamped_experts(dtype)
    for t in TOKENS:
        for k in (1, 2, 4, 8):
            _check(experts, t, k, dtype, exact=k == 2)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_int8_experts_equal_the_grouped_reference(dtype):
    experts = _int8_experts(dtype)
    for t in TOKENS:
        for k in (1, 3, 8):
            _check(experts, t, k, dtype, exact=k == 3)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_int8_clamped_experts_equal_the_grouped_reference(dtype):
    """gpt-oss under --quantization int8: each expert's projections on Int8Linear's kernel for its rows (the int8
    GEMV up to its row limit, the dequantised linear above), each bias added after the rounding to the activation
    dtype, the clamped SwiGLU: the same bits as PackedClampedExperts.run expert by expert."""
    experts = _int8_clamped_experts(dtype)
    for t in TOKENS:
        for k in (1, 2, 4, 8):
            _check(experts, t, k, dtype, exact=k == 2)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_across_threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for experts, dtype in ((_float_experts(torch.bfloat16, 2), torch.bfloat16),
                               (_clamped_experts(torch.float32, 2), torch.float32),
                               (_int8_experts(torch.float32, 2), torch.float32)):
            for t in (1, 4, 33):
                _check(experts, t, 8, dtype)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_at_a_wider_shape(dtype):
    """Rows wide and many enough that every loop of the op and the GEMV's column split cover the threads."""
    experts = _float_experts(dtype, seed=5, n=16, h=1024, width=512)
    g = torch.Generator().manual_seed(6)
    for t in (1, 2, 16, 64):
        x = torch.randn(t, 1024, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(t)])
        weights = torch.rand(t, 4, generator=g).to(dtype)
        assert torch.equal(experts.grouped(x, ids, weights)[0], grouped_experts(x, ids, weights, experts)[0])


def test_a_local_range_of_experts():
    """Experts 4..7 only (an expert-parallel rank's): pairs routed elsewhere are skipped, the counts are the
    local experts'; the reference is grouped_experts over those four and a fifth taking the rest at weight 0."""
    experts = _float_experts(torch.float32, seed=3)
    first, local = 4, 4
    op = cpu_ops.moe_dense(experts.gate_up_proj[first:first + local].unbind(0),
                           experts.down_proj[first:first + local].unbind(0), EXPERT_GEMV_ROWS[torch.float32], first)
    sub = _float_experts(torch.float32, n=local + 1)
    sub.gate_up_proj.data, sub.down_proj.data = (p[first:first + local + 1].clone()
                                                 for p in (experts.gate_up_proj, experts.down_proj))
    sub.fused = False
    for t, k in ((1, 8), (6, 3), (9, 8)):
        x, ids, weights = _routing(t, k, torch.float32, seed=t)
        out, counts = op.run(x, ids, weights)
        inside = (ids >= first) & (ids < first + local)
        ref = grouped_experts(x, torch.where(inside, ids - first, local), torch.where(inside, weights, 0), sub)[0]
        assert torch.equal(out, ref)
        assert counts.tolist() == [int((ids == first + e).sum()) for e in range(local)]
    x, ids, weights = _routing(3, 2, torch.float32)
    out, counts = op.run(x, ids % first, weights)  # no pair routed here: zeros
    assert not out.any() and not counts.any()


def test_where_the_op_does_not_apply_the_reference_runs():
    x, ids, weights = _routing(5, 2, torch.float32)
    experts = _float_experts(torch.bfloat16)
    assert experts._fused(x) is None  # rows in another dtype than the weights
    assert experts.fused_rows(torch.float32) == 0
    experts.fused = False
    assert experts._fused(x.bfloat16()) is None and experts.fused_rows(torch.bfloat16) == 0
    clamped = _clamped_experts(torch.bfloat16)
    assert clamped._fused(x) is None and clamped._fused(x.bfloat16().to("meta")) is None  # rows' dtype; off the CPU
    biased = [Int8Linear(torch.randn(2 * WIDTH, H), torch.randn(2 * WIDTH), torch.float32) for _ in range(E)]
    down = [Int8Linear(torch.randn(H, WIDTH), None, torch.float32) for _ in range(E)]
    assert PackedExperts(biased, down)._fused(x) is None
    assert _int8_experts(torch.bfloat16)._fused(x) is None  # float32 rows, bfloat16 activations
    clamped = _int8_clamped_experts(torch.float32)  # gpt-oss's, int8, with biases of another dtype
    clamped.down_proj_bias = torch.nn.Parameter(clamped.down_proj_bias.detach().bfloat16(), requires_grad=False)
    assert clamped._fused(x) is None and clamped.fused_rows(torch.float32) == 0


def _move_int8(experts):
    for m in experts.linears():
        m.weight_int8 = m.weight_int8.clone()


def _move_stacked(experts):
    for name, p in list(experts.named_parameters()):
        setattr(experts, name, torch.nn.Parameter(p.detach().clone(), requires_grad=False))


# each kind of experts the op runs: (experts, how its weights move)
KINDS = {"float": (lambda: _float_experts(torch.float32), _move_stacked),
         "clamped": (lambda: _clamped_experts(torch.float32), _move_stacked),
         "int8": (lambda: _int8_experts(torch.float32), _move_int8),
         "int8-clamped": (lambda: _int8_clamped_experts(torch.float32), _move_int8)}


@pytest.mark.parametrize("kind", KINDS)
def test_moved_weights_rebuild_the_op(kind):
    make, move = KINDS[kind]
    check_moved_weights_rebuild_the_op(make(), move, *_routing(3, 4, torch.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_a_built_op_refuses_bad_input(kind):
    experts = KINDS[kind][0]()
    x, ids, weights = _routing(2, 2, torch.float32)
    op = experts._fused(x)
    check_run_refuses_bad_input(op, x, ids, weights)
    with pytest.raises(RuntimeError, match="activation dtype"):
        op.run(x.bfloat16(), ids, weights)


def test_bad_weights_are_refused():
    ex = _float_experts(torch.float32)
    gate_up, down = list(ex.gate_up_proj.unbind(0)), list(ex.down_proj.unbind(0))
    with pytest.raises(RuntimeError, match="as many"):
        cpu_ops.moe_dense(gate_up[:2], down[:3], 1)
    with pytest.raises(RuntimeError, match=r"\[2I, H\]"):
        cpu_ops.moe_dense(down, down, 1)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ops.moe_dense(gate_up[:1] + [gate_up[1].bfloat16()], down[:2], 1)
    with pytest.raises(RuntimeError, match="scale"):
        cpu_ops.moe_dense([w.to(torch.int8) for w in gate_up], [w.to(torch.int8) for w in down], 16)
    c = _clamped_experts(torch.float32)
    biases = (c.gate_up_proj_bias.detach(), c.down_proj_bias.detach())
    with pytest.raises(RuntimeError, match="comes with both biases"):
        cpu_ops.moe_dense(gate_up, down, 1, act=1)
    with pytest.raises(RuntimeError, match="comes with both biases"):
        cpu_ops.moe_dense(gate_up, down, 1, biases=biases)
    with pytest.raises(RuntimeError, match=r"\[E, 2I\]"):
        cpu_ops.moe_dense(gate_up, down, 1, biases=biases[::-1], act=1)
    with pytest.raises(RuntimeError, match="activation dtype"):
        cpu_ops.moe_dense(gate_up, down, 1, biases=tuple(b.bfloat16() for b in biases), act=1)
    q = _int8_clamped_experts(torch.float32)
    weights = [[m.weight_int8 for m in ms] for ms in (q.gate_up, q.down)]
    scales = [[m._scale_f32 for m in ms] for ms in (q.gate_up, q.down)] + [[m.scale for m in ms]
                                                                         for ms in (q.gate_up, q.down)]
    with pytest.raises(RuntimeError, match="activation dtype"):  # int8: the biases in the scales' dtype
        cpu_ops.moe_dense(*weights, 16, scales=scales, biases=tuple(b.bfloat16() for b in biases), act=1)
    assert cpu_ops.moe_dense(*weights, 16, scales=scales, biases=biases, act=1, alpha=ALPHA, limit=LIMIT) is not None
    with pytest.raises(RuntimeError, match="act 0"):
        cpu_ops.moe_dense(gate_up, down, 1, biases=biases, act=2)


@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                         ("bfloat16", "int8")])
@pytest.mark.parametrize("family", (*MOE_FAMILIES, "gpt_oss"))
def test_each_family_s_sparse_blocks_equal_the_reference(tmp_path, family, dtype, quant):
    """Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE and gpt-oss as they load (float experts) and under
    --quantization int8: every sparse block's forward on the fused op equals it on grouped_experts, at decode
    batches 1, 3, 9 and a prefill chunk of 40 rows; the decode plan covers the model."""
    path = make_tiny_hf_model(tmp_path, family, vocab_size=256, with_tokenizer=False)
    llm = LLM(model=str(path), dtype=dtype, quantization=quant, skip_tokenizer_init=True, num_kv_blocks=16,
              max_model_len=64)
    model = llm.engine.runner.executor.model
    assert llm.engine.runner.executor.decode_plan is not None
    g = torch.Generator().manual_seed(0)
    for _, block in moe_blocks(model):
        assert block.experts.fused_op() is not None
        for t in (1, 3, 9, 40):
            x = torch.randn(t, model.config.hidden_size, generator=g).to(block.gate.weight.dtype)
            with torch.inference_mode():
                fused = block(x)
                block.experts.fused = False
                try:
                    ref = block(x)
                finally:
                    block.experts.fused = True
            assert torch.equal(fused, ref), f"{family} {dtype} {quant} t={t}"
