"""`servescope quantize`: quantise a float model once, with plain rounding, importance-weighted rounding
(llama.cpp's imatrix) or GPTQ on calibration activations, and save it packed (loader/quantized.py), so
that later runs load it as it is.

The steps, on the float32 engine of the source model:
  1. calibration sequences: the model's own samples (method "self": temperature 1 from a few one-word
     starts, seeded; no text needed, and in the model's own distribution) or a text file cut into
     sequences of `tokens` tokens;
  2. each projection's H = X^T X, summed over the calibration tokens: a forward hook on every module
     of model.projections() during one prefill per sequence (`sequence_logits`);
  3. per projection, in the scheme the mode gives it (the 4-bit modes' head is 8-bit,
     model/quantize.projection_scheme): gptq_quantize (quant/gptq.py; its group scales searched with diag(H)
     as each input's importance), quantize with importance = diag(H) / tokens (each input's mean squared
     activation: "imatrix"), or plain quantize; and the output error each one leaves,
     tr((W - Q) H (W - Q)^T) / tr(W H W^T), for both, which the summary reports;
  4. the fused q/k/v and gate/up rows split back into their Hugging Face tensors, and the directory
     written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from servescope.config.families import family
from servescope.engine import calibrate_experts
from servescope.engine.llm import LLM
from servescope.engine.model_runner import ModelRunner
from servescope.errors import InvalidParameterError
from servescope.quant.packed import dequantize, quantize
from servescope.quant.scheme import QuantScheme
from servescope.loader.output_dir import check_destination
from servescope.loader.quantized import save_quantized, saved_mode
from servescope.quant.gptq import DAMP, gptq_quantize
from servescope.model.quantize import embedding_scheme, parse_mode, projection_scheme

logger = logging.getLogger(__name__)

METHODS = ("gptq", "imatrix", "rtn")
# one-word starts of the model's own calibration samples (sample i starts with STARTS[i % len])
STARTS = ("The", "In", "A", "When", "It", "We", "One", "There", "Many", "This", "After", "If", "Our", "How",
          "def", "Dear")


@dataclass
class QuantizeReport:
    out: str
    mode: str
    method: str
    calibration_tokens: int
    seconds: dict = field(default_factory=dict)  # stage -> wall seconds
    # per projection: (name, relative output error of this method, of plain rounding)
    errors: list = field(default_factory=list)
    # per routed expert's projection a calibration token reached: (name, importance-weighted error of the
    # method, of plain rounding) (engine/calibrate_experts.py)
    expert_errors: list = field(default_factory=list)
    file_bytes: int = 0

    @property
    def mean_error_ratio(self) -> float:
        """The mean over projections of (this method's output error / plain rounding's)."""
        ratios = [e / r for _, e, r in self.errors if r > 0]
        return sum(ratios) / len(ratios) if ratios else 1.0


def sequence_logits(engine, ids: list) -> torch.Tensor:
    """float32 logits [len(ids), V] of every position: one prefill through a private paged cache."""
    bs = engine.cache_config.block_size
    nblocks = -(-len(ids) // bs)
    runner = ModelRunner(engine.executor.fork(), engine.model_config, engine.runner.backend, nblocks, bs,
                         engine.kv_dtype, engine.device)
    req = SimpleNamespace(all_token_ids=list(ids))
    seq = SimpleNamespace(request=req, num_computed_tokens=0, num_new_tokens=len(ids), block_ids=list(range(nblocks)),
                          spec_token_ids=())
    with torch.inference_mode():
        batch = runner.prepare([seq])
        hidden = runner.executor.forward(batch, runner.kv_caches, runner.backend)
        return runner.executor.compute_logits(hidden).float()


def calibration_sequences(llm: LLM, calibration: str, samples: int, tokens: int, seed: int) -> list:
    """Token id lists: the model's own samples ("self"), or a UTF-8 text file cut into `tokens`-token
    pieces (at most `samples` of them)."""
    from servescope.config.sampling import SamplingParams  # lazy: config/ re-exports it at import

    if calibration == "self":
        if llm.tokenizer is None:  # token ids: one start token each, spread over the vocabulary
            vocab = llm.engine.model_config.vocab_size
            prompts = [[(seed * 31 + 7919 * i + 1) % vocab] for i in range(samples)]
        else:
            prompts = [STARTS[i % len(STARTS)] for i in range(samples)]
        params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=seed + i, ignore_eos=True)
                  for i in range(samples)]
        return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    try:
        with open(calibration, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameterError("calibration", f"cannot read calibration text {calibration!r}: {e}") from None
    if llm.tokenizer is None:
        raise InvalidParameterError("calibration", "a calibration text needs the model's tokenizer; this one has none "
                                    "(use --calibration self)")
    ids = llm.tokenizer.encode(text)
    if len(ids) < tokens:
        raise InvalidParameterError("calibration", f"{calibration} has {len(ids)} tokens, fewer than one "
                                    f"calibration sequence ({tokens}); give more text or fewer --calibration-tokens")
    return [ids[i:i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)][:samples]


def projection_hessians(llm: LLM, seqs: list) -> list:
    """[X^T X (float64 [K, K]) of each module of model.projections(), over every calibration token]."""
    projs = llm.engine.executor.model.projections()
    hess = [None] * len(projs)

    def hook(i):
        def add(_mod, inputs, _out):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hess[i] = x.T @ x if hess[i] is None else hess[i].addmm_(x.T, x)
        return add

    handles = [m.register_forward_hook(hook(i)) for i, (_, _, m) in enumerate(projs)]
    try:
        for ids in seqs:
            sequence_logits(llm.engine, ids)
    finally:
        for h in handles:
            h.remove()
    return hess


def output_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) / tr(W H W^T): the layer's output error on the calibration inputs."""
    e, w = (w - wq).double(), w.double()
    return float(((e @ h) * e).sum() / ((w @ h) * w).sum().clamp_min(1e-300))


def quantize_checkpoint(model, mode: str, out: str, method: str = "gptq", calibration: str = "self",
                        samples: int = 64, tokens: int = 128, seed: int = 0, damp: float | None = None,
                        skip_tokenizer_init: bool = False) -> QuantizeReport:
    """Quantise `model` (a name, .gguf or HF directory) to `mode` with `method` and save it to `out`
    (damp: GPTQ's, None for quant/gptq.DAMP; skip_tokenizer_init: a model without tokenizer files; it is
    saved without one)."""
    damp = DAMP if damp is None else damp
    scheme = parse_mode(mode)
    if not isinstance(scheme, QuantScheme):
        raise InvalidParameterError("quantization", f"{mode!r} is not a packed mode: servescope quantize saves "
                                    "int4 or int<4|8>-<g32|g64|g128|ch>[-sym|-asym] (per-channel int8: int8-ch)")
    if method not in METHODS:
        raise InvalidParameterError("method", f"unknown method {method!r}: use {' or '.join(METHODS)}")
    if samples < 1 or tokens < 2:
        raise InvalidParameterError("calibration", "need at least 1 calibration sample of at least 2 tokens")
    if isinstance(model, str) and saved_mode(model) is not None:
        raise InvalidParameterError("model", f"{model} is already quantised ({saved_mode(model)}); quantise the "
                                    "float model it came from")
    check_destination(out)  # (before the minutes of work, and again when writing)
    report = QuantizeReport(out, mode, method, 0)
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", num_kv_blocks=max(64, samples * -(-(tokens + 16) // 16)),
              skip_tokenizer_init=skip_tokenizer_init)
    report.seconds["load"] = time.perf_counter() - t0
    projs = llm.engine.executor.model.projections()
    check_saveable(llm.engine.executor.model, projs, mode)
    hess, stats = [None] * len(projs), None  # (plain rounding needs no calibration)
    calibrated = method != "rtn"
    if calibrated:
        t0 = time.perf_counter()
        seqs = calibration_sequences(llm, calibration, samples, tokens, seed)
        report.calibration_tokens = sum(map(len, seqs))
        with calibrate_experts.ExpertStats(llm.engine.executor.model) as stats:
            hess = projection_hessians(llm, seqs)
        report.seconds["calibrate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    quantised = []
    for (_, name, mod), h in zip(projs, hess):
        s = projection_scheme(name, scheme)
        w = mod.weight.detach().float()
        q, sc = quantize(w, s)
        if h is not None:
            q_rtn, sc_rtn = q, sc
            if method == "imatrix":
                q, sc = quantize(w, s, importance=torch.diag(h) / report.calibration_tokens)
            else:
                q, sc = gptq_quantize(w, h, s, damp, weighted_scales=True)
            report.errors.append((name, output_error(w, dequantize(q, sc, w.shape[1]), h),
                                  output_error(w, dequantize(q_rtn, sc_rtn, w.shape[1]), h)))
        quantised.append((q, sc, mod))
    report.seconds["quantize"] = time.perf_counter() - t0
    tensors = checkpoint_tensors(llm, projs, quantised, scheme)
    experts, report.expert_errors = calibrate_experts.expert_tensors(
        llm.engine.executor.model, scheme, stats, llm.engine.model_config.architecture)
    tensors.update(experts)
    quant_config = {"mode": mode, "method": method, "calibration": calibration if calibrated else None,
                    "calibration_tokens": report.calibration_tokens if calibrated else 0,
                    "damp": damp if method == "gptq" else None}
    cfg = llm.engine.model_config
    report.out = save_quantized(out, cfg.to_hf_dict(), quant_config, tensors, llm.tokenizer,
                                llm.engine.loaded.eos_token_ids)
    report.file_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return report


def check_saveable(model, projs: list, mode: str) -> None:
    """The file holds norms, the swappable projections, the embedding (checkpoint_tensors) and softmax-routed
    experts with their routers (calibrate_experts): a model with any other parameter (gpt-oss's expert biases
    and sinks, DeepSeek's routers and latent attention's kv_b_proj) is refused here, before any work, instead
    of written without it and failing at load."""
    names = {id(mod): prefix for prefix, mod in model.named_modules()}
    saved = ({names[id(mod)] for _, _, mod in projs} | {"model.embed_tokens", "lm_head"}
             | calibrate_experts.saveable_modules(model))
    missing = [n for n, _ in model.named_parameters()
               if not n.endswith("norm.weight") and n.rpartition(".")[0] not in saved]
    if missing:
        raise InvalidParameterError("model", f"servescope quantize does not save {len(missing)} of this model's "
                                    f"tensors yet ({', '.join(missing[:3])}, ...): load the float model with "
                                    f"--quantization {mode} instead")


def checkpoint_tensors(llm: LLM, projs: list, quantised: list, scheme: QuantScheme) -> dict:
    """The file's tensors in Hugging Face names: the norms from the model's state dict, each fused
    projection's rows split back into its parts, and the packed embedding (loader/quantized.py): tied,
    the head's own quantised rows renamed (one copy serves both); untied, the table rounded in the
    mode's scheme (plain rounding: a lookup has no inputs to calibrate on)."""
    model, cfg = llm.engine.executor.model, llm.engine.model_config
    names = {id(mod): prefix for prefix, mod in model.named_modules()}
    offset = family(cfg.architecture).norm_offset  # the checkpoint's norms as the family writes them (Gemma: w - 1)
    tensors = {n: t.float() - offset for n, t in model.state_dict().items() if n.endswith("norm.weight")}
    if cfg.tie_word_embeddings:
        q, sc, _ = next(item for item in quantised if item[2] is model.lm_head)
        quantised = [item for item in quantised if item[2] is not model.lm_head]
    else:
        emb = model.model.embed_tokens.weight.detach().float()
        q, sc = quantize(emb, embedding_scheme(scheme, False))
    tensors["model.embed_tokens.qweight"], tensors["model.embed_tokens.scales"] = q, sc
    for q, sc, mod in quantised:
        prefix = names[id(mod)]
        parent, _, attr = prefix.rpartition(".")
        splits = {"qkv_proj": (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)),
                  # (a shared expert's width is its own: the rows in halves)
                  "gate_up_proj": (("gate_proj", q.shape[0] // 2), ("up_proj", q.shape[0] // 2))}
        parts = splits.get(attr, ((attr, q.shape[0]),))
        r0 = 0
        for part, rows in parts:
            base = f"{parent}.{part}" if parent else part
            tensors[base + ".qweight"], tensors[base + ".scales"] = q[r0:r0 + rows], sc[r0:r0 + rows]
            if mod.bias is not None:
                tensors[base + ".bias"] = mod.bias.detach().float()[r0:r0 + rows]
            r0 += rows
    return tensors
