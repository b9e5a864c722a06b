"""--quantization int4 | int8 packs the embedding table too (issue 35): its rows are dequantised on lookup,
a tied table and head are one packed copy, and `servescope quantize` saves and reloads that copy."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from servescope import LLM
from servescope.engine.calibrate import quantize_checkpoint, sequence_logits
from servescope.model.linears.int8 import Int8Linear
from servescope.model.linears.packed import QuantEmbedding, QuantLinear, kept_int8, kept_panel
from servescope.quant.packed import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

KW = dict(skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
IDS = [(i * 37 + 11) % 500 + 3 for i in range(24)]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tied"), "llama", vocab_size=512,
                                  with_tokenizer=False, num_hidden_layers=2, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("untied"), "llama", vocab_size=512,
                                  with_tokenizer=False, num_hidden_layers=2, tie_word_embeddings=False))


def _float_table(path: str) -> torch.Tensor:
    return load_file(str(Path(path, "model.safetensors")))["model.embed_tokens.weight"]


@pytest.mark.parametrize("mode,head_dtype", [("int4", torch.int8), ("int8-g32", torch.int8),
                                             ("int4-g64-asym", torch.int8)])
def test_tied_table_and_head_are_one_packed_copy(tied, mode, head_dtype):
    float_llm, llm = LLM(model=tied, **KW), LLM(model=tied, quantization=mode, **KW)
    model = llm.engine.executor.model
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear)
    assert emb.qweight is head.qweight and emb.scales is head.scales  # the same tensors, not copies
    assert head.qweight.dtype == head_dtype  # the 4-bit modes' head (and so the tied table) is 8-bit
    assert not any(t.dtype == torch.float32 and t.shape == (512, 64) for t in model.buffers())
    assert not any(p.shape == (512, 64) for p in model.parameters())
    ids = torch.tensor(IDS)
    # where the kernels keep (int8) panels, the head is in them and the table reads them
    assert head.panel == (kept_panel() if kept_int8() else 0)
    want = dequantize(*head.plain_weights(), 64)[ids]
    assert torch.equal(emb(ids), want)  # the lookup is the head's own rows, dequantised
    assert (want - _float_table(tied)[ids]).abs().max() < 0.02  # and close to the float table
    # the float table (512 x 64 float32) is gone from the weights, the packed head counted once
    saved = 512 * 64 * 4
    assert llm.engine.weight_bytes < float_llm.engine.weight_bytes - saved


def test_per_channel_int8_table_is_the_heads_int8_rows(tied):
    llm = LLM(model=tied, quantization="int8", **KW)
    model = llm.engine.executor.model
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(head, Int8Linear) and emb.qweight is head.weight_int8 and emb.scales is head.scale
    ids = torch.tensor(IDS)
    want = head.weight_int8[ids].float() * head.scale[ids, None].float()
    assert torch.equal(emb(ids), want)
    assert torch.isfinite(sequence_logits(llm.engine, IDS)).all()


def test_untied_table_takes_the_modes_own_scheme(untied):
    model = LLM(model=untied, quantization="int4", **KW).engine.executor.model
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, QuantEmbedding) and emb.qweight is not head.qweight
    assert emb.qweight.dtype == torch.uint8 and tuple(emb.qweight.shape) == (512, 32)  # int4 g32: token_embd
    assert head.qweight.dtype == torch.int8  # the head keeps 8 bits
    ids = torch.tensor(IDS)
    assert (emb(ids) - _float_table(untied)[ids]).abs().max() < 0.05


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_saved_checkpoint_round_trips_the_packed_table(which, tied, untied, tmp_path):
    src = tied if which == "tied" else untied
    out = quantize_checkpoint(src, "int4", str(tmp_path / "q"), method="rtn", skip_tokenizer_init=True).out
    names = set(load_file(str(Path(out, "model.safetensors"))))
    assert {"model.embed_tokens.qweight", "model.embed_tokens.scales"} <= names
    assert "model.embed_tokens.weight" not in names
    assert ("lm_head.qweight" in names) == (which == "untied")  # tied: the one copy is the embedding's
    saved, at_load = LLM(model=out, **KW), LLM(model=src, quantization="int4", **KW)
    a, b = saved.engine.executor.model, at_load.engine.executor.model
    assert torch.equal(a.model.embed_tokens.qweight, b.model.embed_tokens.qweight)
    assert torch.equal(a.model.embed_tokens.scales, b.model.embed_tokens.scales)
    assert (a.model.embed_tokens.qweight is a.lm_head.qweight) == (which == "tied")
    assert torch.equal(sequence_logits(saved.engine, IDS), sequence_logits(at_load.engine, IDS))
    assert saved.engine.weight_bytes == at_load.engine.weight_bytes
