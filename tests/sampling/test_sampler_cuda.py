"""On CUDA: no host sync before the results are copied back, and the same answers as on CPU."""

import pytest
import torch

from servescope.config import SamplingParams
from servescope.sampling import Sampler, SamplingState
from .test_sampler import run_seeded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def mixed_states(device):
    return [
        SamplingState.new(SamplingParams(temperature=0.0), [1, 2], device),
        SamplingState.new(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=3), [4], device),
        SamplingState(SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
                                     presence_penalty=0.5, min_tokens=4), [5, 6], [7, 7, 8], None),
        SamplingState.new(SamplingParams(temperature=0.5, seed=9, logprobs=5), [1], device),
    ]


def test_sample_runs_without_host_sync():
    sampler = Sampler(1000, eos_token_ids=[2])
    logits = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    states = mixed_states("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        greedy = [s.params.temperature < 1e-5 for s in states]
        ids = sampler._sample(logits[:, :1000], states, greedy)
        fast = sampler._sample(logits[:1, :1000], states[:1], greedy[:1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ids.shape == (4,) and fast.shape == (1,)
    out = sampler(logits, states)  # the one sync: results to the host
    assert out.logprobs[3] is not None and len(out.logprobs[3].top) == 5


def test_greedy_and_logprobs_match_cpu():
    torch.manual_seed(0)
    logits = torch.randn(8, 3000)
    sampler = Sampler(3000, eos_token_ids=[0])
    def states(device):
        return [SamplingState(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.2 if i % 2 else 1.0),
                              [i, i + 1], [i + 2], None) for i in range(8)]
    cpu = sampler(logits, states("cpu"))
    gpu = sampler(logits.cuda(), states("cuda"))
    assert cpu.token_ids == gpu.token_ids
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert a.rank == b.rank and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_independent_of_batch_on_cuda():
    alone = run_seeded(7, 6, [], 0, device="cuda")
    assert alone == run_seeded(7, 6, [], 0, device="cuda")
    assert alone == run_seeded(7, 6, [dict(seed=3), dict(temperature=0.0), dict(top_k=5)], 1, device="cuda")
