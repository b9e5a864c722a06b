"""LayerSpec: what one decoder layer computes, as data.

A decoder is a list of layer specs (ModelConfig.layer_specs). The model builds each layer from its
spec (model/decoder.py: one module class per attention kind and per MLP kind), the cost model and
the memory planner read the same specs, and a family is a config mapping onto them
(config/families.py). Only the kinds the model implements are accepted: a spec naming another is an
error at load time, never a silently different model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from servescope.config.mla import MlaSpec
from servescope.config.moe import ExpertsSpec
from servescope.errors import InvalidParameterError

# "full": causal attention over the whole context; "sliding": over the last `window` positions only (the
# query at position p sees keys p - window + 1 .. p, transformers' sliding_window semantics); "latent": DeepSeek's
# multi-head latent attention over the whole context (config/mla.py: the cache holds one latent row per token)
ATTENTION_KINDS = ("full", "sliding", "latent")
# "dense": a gated MLP, down(act(gate(x)) * up(x)); "moe": routed experts of that shape (config/moe.py)
MLP_KINDS = ("dense", "moe")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gate's activation (Gemma: GELU, tanh approximation)
# "pre": an RMSNorm before attention and before the MLP, residual adds after each; "sandwich" (Gemma 2/3): also
# an RMSNorm on the attention's and on the MLP's output before their residual adds (four per layer)
NORM_PLACEMENTS = ("pre", "sandwich")


@dataclass(frozen=True)
class AttentionSpec:
    kind: str = "full"
    bias: bool = False  # a bias on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's features of q and k before rotary (Qwen3)
    window: int = 0  # kind "sliding": keys within this many positions of the query (0 for "full")
    qk_norm_all_heads: bool = False  # the q/k norm over all heads' features at once (OLMoE), not per head
    # attention-logit soft-capping (Gemma 2): each score s becomes softcap * tanh(s / softcap); 0: none
    softcap: float = 0.0
    # learned attention sinks (gpt-oss): one logit per query head joins the softmax's denominator only
    sinks: bool = False
    out_bias: bool = False  # a bias on the output projection (gpt-oss)
    # the rotary base of this layer when it is not the model's (Gemma 3's local layers: plain rope at
    # rope_local_base_freq); 0: the model's rope_theta and rope_scaling
    rope_theta: float = 0.0
    latent: Optional[MlaSpec] = None  # kind "latent": the latent's shape (config/mla.py)

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise InvalidParameterError("attention", f"attention kind {self.kind!r} is not implemented "
                                                     f"(implemented: {', '.join(ATTENTION_KINDS)})")
        if (self.kind == "sliding") != (self.window > 0):
            raise InvalidParameterError("sliding_window", f"attention kind {self.kind!r} with window {self.window}: "
                                                          "a sliding layer needs a positive window, a full one none")
        if (self.kind == "latent") != (self.latent is not None):
            raise InvalidParameterError("kv_lora_rank", f"attention kind {self.kind!r} with latent {self.latent}: "
                                                        "a latent layer needs its MlaSpec, the others none")
        if self.latent is not None and (self.qk_norm or self.softcap or self.sinks or self.rope_theta):
            raise InvalidParameterError("kv_lora_rank", "latent attention with q/k norms, soft-caps, sinks or a "
                                                        "layer rotary base is not implemented")
        if self.softcap < 0 or self.rope_theta < 0:
            raise InvalidParameterError("attn_logit_softcapping", "softcap and rope_theta must not be negative")

    @property
    def plain_softmax(self) -> bool:
        """The scores go straight into the softmax (no soft-cap, no sink): what every kernel computes."""
        return not self.softcap and not self.sinks


@dataclass(frozen=True)
class MlpSpec:
    kind: str = "dense"
    activation: str = "silu"
    experts: Optional[ExpertsSpec] = None  # kind "moe": the router and the experts

    def __post_init__(self):
        if self.kind not in MLP_KINDS:
            raise InvalidParameterError("mlp", f"MLP kind {self.kind!r} is not implemented "
                                               f"(implemented: {', '.join(MLP_KINDS)})")
        if self.activation not in ACTIVATIONS:
            raise InvalidParameterError("hidden_act", f"activation {self.activation!r} is not implemented "
                                                      f"(implemented: {', '.join(ACTIVATIONS)})")
        if (self.kind == "moe") != (self.experts is not None):
            raise InvalidParameterError("mlp", f"MLP kind {self.kind!r} with experts {self.experts}: a "
                                               "sparse layer needs its experts, a dense one none")


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    mlp: MlpSpec = field(default_factory=MlpSpec)
    norm: str = "pre"

    def __post_init__(self):
        if self.norm not in NORM_PLACEMENTS:
            raise InvalidParameterError("norm", f"norm placement {self.norm!r} is not implemented "
                                                f"(implemented: {', '.join(NORM_PLACEMENTS)})")


def first_in_view(num_computed: int, window: int, block_size: int) -> int:
    """The first block a query at position num_computed reads in layers of `window` (0: the whole context)."""
    return max(0, num_computed - window + 1) // block_size if window else 0


def window_of(specs) -> int:
    """The window every layer of `specs` attends over, 0 when any layer attends over the whole context
    (then the KV cache keeps every block; config/layers.py's kinds)."""
    windows = {s.attention.window for s in specs}
    return windows.pop() if len(windows) == 1 else 0
