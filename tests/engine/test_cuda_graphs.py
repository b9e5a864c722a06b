"""CUDA-graph decode replays equal the eager forward (needs CUDA and Triton; skipped otherwise)."""

from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA graphs need a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from servescope.config import ModelConfig  # noqa: E402
from servescope.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from servescope.engine.executor import ModelExecutor  # noqa: E402
from servescope.engine.model_runner import ModelRunner  # noqa: E402
from servescope.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from servescope.model.decoder import CausalLM  # noqa: E402

DEV = torch.device("cuda")
S = 16


def _setup(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=1024)
    model = CausalLM(cfg).to(DEV, dtype).eval().requires_grad_(False)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    runner = ModelRunner(ModelExecutor(model, DEV), cfg, TritonAttentionBackend(), num_blocks=64,
                         block_size=S, kv_dtype=dtype, device=DEV)
    for k, v in runner.kv_caches:  # stands in for earlier prefills
        k.normal_()
        v.normal_()
    return model, runner


def _decodes(lens, first_block=1):
    """Scheduled decode sequences with context lengths `lens` after this step."""
    seqs, nxt = [], first_block
    for i, n in enumerate(lens):
        nblk = (n + S - 1) // S
        blocks = list(range(nxt, nxt + nblk))
        nxt += nblk
        req = SimpleNamespace(all_token_ids=[(7 * i + j) % 256 for j in range(n)])
        seqs.append(SimpleNamespace(request=req, num_computed_tokens=n - 1, num_new_tokens=1,
                                    block_ids=blocks, spec_token_ids=()))
    return seqs


def test_graph_replay_matches_eager_and_padding_writes_nothing():
    model, runner = _setup()
    graphs = CudaGraphRunner(model, runner, batch_sizes=[1, 2, 4, 8], max_blocks_per_seq=8)
    graphs.capture()
    assert graphs.capture_seconds is not None
    for lens in ([5], [17, 40, 3], [1, 16, 33, 64, 100]):  # B = 1, 3 (pad to 4), 5 (pad to 8)
        scheduled = _decodes(lens)
        eager = runner.execute(scheduled)  # [B, V]; writes the step's K, V
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        batch = runner.prepare(scheduled)
        assert graphs.can_run(batch)
        runner.executor.graphs = graphs
        replay = runner.execute(scheduled)
        runner.executor.graphs = None
        torch.testing.assert_close(replay, eager, atol=1e-4, rtol=1e-4)
        # the replay rewrote the same slots with the same values; padded rows wrote nothing
        for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
            torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


def test_can_run_rejects_what_was_not_captured():
    model, runner = _setup()
    graphs = CudaGraphRunner(model, runner, batch_sizes=[1, 2], max_blocks_per_seq=2)
    assert not graphs.can_run(runner.prepare(_decodes([3])))  # nothing captured yet
    graphs.capture()
    assert graphs.can_run(runner.prepare(_decodes([3, 32])))
    assert not graphs.can_run(runner.prepare(_decodes([3, 4, 5])))  # B above the largest graph
    assert not graphs.can_run(runner.prepare(_decodes([33])))  # 3 blocks > max_blocks_per_seq
    prefill = SimpleNamespace(request=SimpleNamespace(all_token_ids=[1, 2, 3]), num_computed_tokens=0,
                              num_new_tokens=3, block_ids=[9], spec_token_ids=())
    assert not graphs.can_run(runner.prepare(_decodes([3]) + [prefill]))  # mixed step
