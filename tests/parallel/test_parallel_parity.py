"""Tensor parallel (TP=2) and pipeline parallel (PP=2) on two gloo processes, one thread each: greedy
tokens identical to one process and logits within 1e-4 at every step, for every family of the parity
tests, with batching, chunked prefill, prefix caching and preemption in the workload."""

import pytest

from helpers_parallel import assert_same_as_single_process
from tiny_models import make_tiny_hf_model

TP_CASES = {
    "llama": {},  # llama3 rope scaling, untied head
    "llama_plain": {},  # tied embeddings: the head shares the vocabulary-parallel embedding's shard
    "mistral": {},
    "qwen2": {},  # q/k/v biases, sharded with their heads
    "qwen3": {},  # per-head q/k norms
    # one KV head < TP=2: each shard holds a replica of it (MQA; GQA with Hkv < T, as vLLM does)
    "llama-mqa": dict(num_key_value_heads=1),
    # a vocabulary that TP=2 does not divide: the last shard is padded
    "qwen2-odd-vocab": dict(vocab_size=49153),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_parallel_2_equals_one_process(tmp_path, case):
    family = case.split("-")[0]
    path = str(make_tiny_hf_model(tmp_path, family, **TP_CASES[case]))
    assert_same_as_single_process(path, tensor_parallel_size=2)


@pytest.mark.parametrize("family, overrides", [
    ("llama", dict(num_hidden_layers=3)),  # untied; an uneven split (2 + 1 layers)
    ("qwen2", {}),  # tied: the last stage keeps the embedding's weight as its head
    ("qwen3", {}),
])
def test_pipeline_parallel_2_equals_one_process(tmp_path, family, overrides):
    path = str(make_tiny_hf_model(tmp_path, family, **overrides))
    assert_same_as_single_process(path, pipeline_parallel_size=2)
