"""/v1/embeddings on a tiny random checkpoint: last-token and mean pooling equal transformers' final
hidden states (normalised), in OpenAI's response shape through the real SDK; bad input is a 400."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from servescope.engine.async_engine import AsyncEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.server.app import build_app

from .server_utils import LiveServer


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("emb"), "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ae = AsyncEngine(LLMEngine(model=str(path), num_kv_blocks=32, max_model_len=256))
    server = LiveServer(build_app(ae, model_name="tiny")).start()
    yield server, hf, ae
    server.stop()
    ae.shutdown()


def _hf_vectors(hf, ids):
    with torch.no_grad():
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # [T, Dm], after the norm
    return torch.nn.functional.normalize(h[-1], dim=0), torch.nn.functional.normalize(h.mean(0), dim=0)


def test_embeddings_match_transformers(tiny_server):
    server, hf, ae = tiny_server
    # the SDK asks for base64 and decodes it after validation, so strict response validation cannot pass
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    texts = ["The capital of France is Paris.", "Embeddings, pooled."]
    tok = ae.engine.tokenizer
    r = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    mean = client.embeddings.create(model="tiny", input=texts, extra_body={"pooling": "mean"})
    for t, d, m in zip(texts, r.data, mean.data):
        last_ref, mean_ref = _hf_vectors(hf, tok.encode(t))
        assert (torch.tensor(d.embedding) - last_ref).abs().max().item() < 1e-4
        assert (torch.tensor(m.embedding) - mean_ref).abs().max().item() < 1e-4
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": [5, 6, 7], "encoding_format": "base64"}).json()
    vec = struct.unpack(f"<{hf.config.hidden_size}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert (torch.tensor(vec) - _hf_vectors(hf, [5, 6, 7])[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("body,param", [({"input": ""}, "input"), ({"input": [10**7]}, "input"),
                                        ({"input": "x", "dimensions": 3}, "dimensions"),
                                        ({"input": "x", "pooling": "max"}, "pooling"),
                                        ({"input": "x", "truncate": 5}, "truncate")])
def test_embeddings_bad_input(tiny_server, body, param):
    server, _, ae = tiny_server
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert ae.num_inflight == 0
