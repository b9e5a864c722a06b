"""A quantised checkpoint saved in the packed form, and read back as it is (issue 15: "quantised at
load, optionally saved").

`servescope quantize` (engine/calibrate.py) writes a Hugging Face style directory:
  config.json             the model's config plus "quantization_config": {"quant_method": "servescope",
                          "mode": the --quantization mode, "method": "rtn" | "gptq", how it was calibrated}
  model.safetensors       norms as float32; each quantised linear as "<name>.qweight" (the packed
                          integers of quant/packed.py) and "<name>.scales" (float16), in Hugging Face
                          names, q/k/v and gate/up apart (the loader fuses them as it fuses a GGUF's);
                          the embedding packed too, as model.embed_tokens.qweight / .scales: for tied
                          embeddings the one copy that is also the head (no lm_head tensors), in the
                          head's scheme; untied, in the mode's (model/quantize.embedding_scheme).
                          Files written before the embedding was packed (a float32
                          model.embed_tokens.weight and a packed lm_head) still load.
                          A mixture of experts' routed experts packed per expert under a GGUF's
                          per-expert names, its routers in float32 (engine/calibrate_experts.py).
  tokenizer files, chat_template.jinja, generation_config.json
The directory is written beside its destination and renamed into place: a failure leaves nothing.

`read_packed` turns such a file into the loader's packed dict ({hf weight name: (packed, scales, K)},
what a GGUF's blocks become, loader/gguf_packed.py), after checking every tensor's dtype and shape
against the mode and the config. `saved_mode(path)` reads only config.json: the engine adopts that mode
(engine/builder.py), so a saved checkpoint runs packed with no flag.
"""

from __future__ import annotations

import json
import os

import torch

from servescope.errors import ModelLoadError
from servescope.quant.scheme import QuantScheme
from servescope.loader.gguf_packed import placeholder
from servescope.loader.output_dir import atomic_directory, check_destination
from servescope.model.quantize import embedding_scheme, parse_mode, projection_scheme

QUANT_METHOD = "servescope"
WEIGHTS = "model.safetensors"


def saved_mode(path: str | None) -> str | None:
    """The quantisation mode a directory was saved with (None: not a servescope-quantised checkpoint)."""
    if not path or not os.path.isdir(path):
        return None
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # the loader reports a broken config.json with its own message
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return None
    mode = qc.get("mode")
    if not isinstance(mode, str):
        raise ModelLoadError(f"{cfg}: quantization_config has no mode")
    return mode


def scheme_of(mode: str, where: str) -> QuantScheme:
    try:
        scheme = parse_mode(mode)
    except Exception as e:
        raise ModelLoadError(f"{where}: quantization_config mode {mode!r}: {e}") from None
    if not isinstance(scheme, QuantScheme):
        raise ModelLoadError(f"{where}: quantization_config mode {mode!r} is not a packed form")
    return scheme


def read_packed(tensors: dict, mode: str, shapes: dict, where: str, tied: bool = False) -> tuple:
    """(dense state dict with float32 placeholders for packed weights, packed dict) from the file's
    tensors. shapes: the config's {hf name: shape} (loader/checkpoint.expected_tensor_shapes); tied: the
    config ties the embedding to the head (its packed table is then in the head's scheme)."""
    scheme = scheme_of(mode, where)
    head, embed = projection_scheme("lm_head", scheme), embedding_scheme(scheme, tied)
    dense, packed = {}, {}
    for name, t in tensors.items():
        if name.endswith(".qweight") or name.endswith(".scales"):
            continue
        dense[name] = t.float() if t.is_floating_point() else t
    for qname in [n for n in tensors if n.endswith(".qweight")]:
        base = qname[: -len(".qweight")]
        wname = base + ".weight"
        if wname not in shapes:
            raise ModelLoadError(f"{where}: packed tensor {qname} is not a weight of this model")
        s = {"lm_head.weight": head, "model.embed_tokens.weight": embed}.get(wname, scheme)
        n, k = shapes[wname]
        q, sc = tensors[qname], tensors.get(base + ".scales")
        if sc is None:
            raise ModelLoadError(f"{where}: {qname} has no {base}.scales")
        kp = s.padded_k(k)
        want_q = (n, kp // 2 if s.bits == 4 else kp)
        want_s = (n, kp // (s.group or kp), *((2,) if s.asym else ()))
        want_dtype = torch.uint8 if s.bits == 4 else torch.int8
        if q.dtype != want_dtype or tuple(q.shape) != want_q or sc.dtype != torch.float16 or tuple(sc.shape) != want_s:
            raise ModelLoadError(
                f"{where}: {base} does not match mode {mode!r}: qweight {str(q.dtype)[6:]} {list(q.shape)} and "
                f"scales {str(sc.dtype)[6:]} {list(sc.shape)}, expected {str(want_dtype)[6:]} {list(want_q)} and "
                f"float16 {list(want_s)}")
        packed[wname] = (q.contiguous(), sc.contiguous(), k)
        dense[wname] = placeholder((n, k))
    return dense, packed


def save_quantized(out: str, config_dict: dict, quant_config: dict, tensors: dict, tokenizer,
                   eos_token_ids) -> str:
    """Write the directory described above, atomically. tensors: {name: tensor} as they go in the file;
    tokenizer: servescope's Tokenizer (its HF tokenizer is saved, and its chat template)."""
    from safetensors.torch import save_file  # lazy: only this command writes safetensors

    out = check_destination(out)
    with atomic_directory(out, ".quantize-") as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**config_dict, "quantization_config": {"quant_method": QUANT_METHOD, **quant_config}}, f,
                      indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": sorted(int(i) for i in eos_token_ids)}, f, indent=2)
        save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(tmp, WEIGHTS))
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(tmp)
            if tokenizer.has_chat_template:
                with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
                    f.write(tokenizer.chat_template)
    return out
