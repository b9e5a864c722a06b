"""Test helpers: run a model over a whole token sequence through the paged-cache path."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from servescope.engine.model_runner import ModelRunner


def paged_logits(engine, ids, chunk=None, decode_from=None):
    """Logits [len(ids), V] of every position, computed by our model through a private paged cache.

    chunk: prefill in chunks of this many tokens; decode_from: positions >= this are fed one token at
    a time (decode steps reading the cache)."""
    cfg = engine.model_config
    bs = engine.cache_config.block_size
    nblocks = -(-len(ids) // bs)
    runner = ModelRunner(engine.executor.fork(), cfg, engine.runner.backend, nblocks, bs, engine.kv_dtype,
                         engine.device)
    req = SimpleNamespace(all_token_ids=list(ids))
    blocks = list(range(nblocks))
    n = len(ids)
    decode_from = n if decode_from is None else decode_from
    spans, p = [], 0
    while p < decode_from:
        q = min(decode_from, p + (chunk or decode_from))
        spans.append((p, q - p))
        p = q
    spans += [(i, 1) for i in range(decode_from, n)]
    out = []
    with torch.inference_mode():
        for start, num in spans:
            seq = SimpleNamespace(request=req, num_computed_tokens=start, num_new_tokens=num,
                                  block_ids=blocks, spec_token_ids=())
            batch = runner.prepare([seq])
            hidden = runner.executor.forward(batch, runner.kv_caches, runner.backend)
            out.append(runner.executor.compute_logits(hidden))
    return torch.cat(out)


# The family parity checks every model family's tests run the same way (test_sliding_window, test_gemma,
# test_moe): transformers' greedy generate, and greedy outputs unchanged by batching, chunking, prefix
# caching and preemption.
BATCHING_OVERRIDES = dict(argvalues=[
    dict(),
    dict(max_num_batched_tokens=16),
    dict(num_kv_blocks=10, max_model_len=128),  # the longest prompt needs 7 blocks of 16 at once
], ids=["batched-prefix-cache", "chunk16", "preemption"])


def random_ids(n, seed):
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_logits_match_transformers(path, hf, chunk, tol):
    """A 120-token prompt in chunks of `chunk`, the last 30 tokens decoded one by one: every row's logits
    within tol of transformers' forward on the same weights."""
    from servescope import LLM  # lazy: as the test modules import it

    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    ids = random_ids(120, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (paged_logits(llm.engine, ids, chunk=chunk, decode_from=90) - ref).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff:.2e}"


def assert_every_field_matters(path, hf, changes: dict, tol):
    """The same weights with one config field changed at a time (`changes`: {key: value}) are far (> 100 tol)
    from transformers' logits on the original: each field is really applied."""
    from servescope import LLM  # lazy: as the test modules import it

    ids = random_ids(60, 2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for key, value in changes.items():
        llm = LLM(model=str(edited_checkpoint(path, key, value)), num_kv_blocks=64, max_model_len=512)
        diff = (paged_logits(llm.engine, ids, chunk=24, decode_from=50) - ref).abs().max().item()
        assert diff > 100 * tol, (key, diff)


def assert_bfloat16_near_float32_transformers(path, hf):
    """bfloat16 weights and cache against transformers in float32, per position of a chunked prompt and its
    decode steps: a few roundings per layer (median <= 0.05); a position whose token sits near a routing tie
    may pick another expert in bfloat16 and move further (95% within 0.1)."""
    from servescope import LLM  # lazy: as the test modules import it

    ids = random_ids(120, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512, dtype="bfloat16")
    per_position = (paged_logits(llm.engine, ids, chunk=24, decode_from=90).float() - ref).abs().max(dim=-1).values
    assert per_position.median().item() <= 0.05
    assert (per_position <= 0.1).float().mean().item() >= 0.95


def edited_checkpoint(path, key, value):
    """A copy of the checkpoint directory `path` with config.json's `key` set to `value`, made once per (key,
    value): two tests editing the same key with different values must not share one."""
    digest = hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]
    out = path.parent / f"{path.name}-{key}-{digest}"
    if not out.exists():
        shutil.copytree(path, out)
        cfg = json.loads((out / "config.json").read_text())
        cfg[key] = value
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def assert_greedy_matches_transformers(path, hf, n):
    """n prompt tokens (seed 3), n greedy tokens: ours equal transformers' generate on the same weights."""
    from servescope import LLM, SamplingParams  # lazy: as the test modules import them

    ids = random_ids(n, 3)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           attention_mask=torch.ones(1, n, dtype=torch.long))[0, n:].tolist()
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == want


def assert_batching_changes_nothing(path, overrides, num_prompts, **llm_kw):
    """num_prompts prompts (every other one behind a shared 40-token prefix: 2.5 blocks), greedy, one engine
    with `overrides` against each prompt alone: the same tokens, and the feature really ran. llm_kw: more LLM
    arguments for both engines (a GGUF without a vocabulary: skip_tokenizer_init)."""
    from servescope import LLM  # lazy: as the test modules import it
    from test_batching import PARAMS, assert_same_greedy  # lazy: a sibling test module on the path

    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 49152, (40,), generator=gen).tolist()
    prompts = [(shared if i % 2 == 0 else []) + torch.randint(3, 49152, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(5, 60, (num_prompts,), generator=gen))]
    base = LLM(model=str(path), num_kv_blocks=96, max_model_len=256, enable_prefix_caching=False, **llm_kw)
    alone = [base.generate(p, PARAMS)[0] for p in prompts]
    llm = LLM(model=str(path), **{"num_kv_blocks": 96, "max_model_len": 256, **overrides, **llm_kw})
    assert_same_greedy(llm.generate(prompts, PARAMS), alone)
    assert max(r.num_running for r in llm.engine.step_records) > 1
    if not overrides:
        assert llm.engine.kv_manager.prefix_cache_hits > 0
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv_manager.check_invariants()
    return llm


def gguf_engine(path, **kw):
    """An LLM over a tiny GGUF file or directory, no tokenizer (the GGUF family tests' engine)."""
    from servescope import LLM

    return LLM(model=str(path), skip_tokenizer_init=True, **{"num_kv_blocks": 64, "max_model_len": 512, **kw})


def transformers_with_weights(hf_dir, state_dict, tmp_path):
    """transformers' model of hf_dir's config with `state_dict` (HF names) as its weights, eager attention."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "weights"
    out.mkdir()
    shutil.copy(hf_dir / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()


def gguf_logits_diff(src, hf_dir, ids, tmp_path) -> float:
    """max |logit| difference between a GGUF file's engine (src: its LoadedSource) and transformers on the same
    weights, through prefill chunks of 24 tokens and decode steps from the 90th (the GGUF family tests' check)."""
    hf = transformers_with_weights(hf_dir, src.state_dict, tmp_path)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    return (paged_logits(gguf_engine(src.path).engine, ids, chunk=24, decode_from=90) - ref).abs().max().item()


def llama_server_greedy(server: str, gguf, ids, tmp_path, n: int = 30) -> tuple:
    """llama.cpp's llama-server on `gguf`: n greedy tokens after the prompt `ids` and, at each step, its top 5
    log-probabilities ({"id", "logprob"} entries, /completion's completion_probabilities)."""
    import socket
    import urllib.request

    from servescope.bench.llama_cpp_tools import LlamaServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [server, "-m", str(gguf), "-t", "1", "-np", "1", "-c", "512", "--no-warmup", "--port", str(port)]
    body = {"prompt": ids, "n_predict": n, "samplers": ["top_k"], "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True, "n_probs": 5}
    with LlamaServer(cmd, log_path=str(tmp_path / "server.log")) as srv:
        req = urllib.request.Request(srv.base_url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
    assert len(reply["tokens"]) == len(reply["completion_probabilities"]) == n
    return reply["tokens"], reply["completion_probabilities"]


def llama_cpp_tree() -> str:
    """llama.cpp's source tree (LLAMA_CPP_DIR), or the test is skipped."""
    root = os.environ.get("LLAMA_CPP_DIR")
    if not root or not os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
        pytest.skip("llama.cpp's tree not given (LLAMA_CPP_DIR)")
    return root


def llama_cpp_convert(root: str, hf_dir, out) -> None:
    """llama.cpp's own convert_hf_to_gguf.py on hf_dir, float32 out, into `out`."""
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "gguf-py")}
    cmd = [sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
           "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


def track_window_holdings(km, max_step_tokens: int) -> dict:
    """Wrap a HybridKVCacheManager's allocate_slots: the returned dict fills with, per group's window, the most
    blocks one sequence held after any allocation of at most max_step_tokens positions (a decode, a
    verification's 1 + k tokens, a draft's lookahead), and checks the tables grow alike at every call."""
    most = {w: 0 for w in km.windows}
    inner = km.allocate_slots

    def allocate(request, num_new_tokens, *args, **kwargs):
        ok = inner(request, num_new_tokens, *args, **kwargs)
        lookahead = kwargs.get("num_lookahead_tokens", args[2] if len(args) > 2 else 0)
        if ok and num_new_tokens + lookahead <= max_step_tokens:
            for w, held in zip(km.windows, km.held_blocks_per_group(request.request_id)):
                most[w] = max(most[w], held)
        return ok

    km.allocate_slots = allocate
    return most
