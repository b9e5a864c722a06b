"""Build a model from a ModelConfig and a checkpoint state dict.

The checkpoint's q/k/v and gate/up tensors are fused into the model's `qkv_proj` / `gate_up_proj`
(`fuse_checkpoint`), then every parameter is a straight copy: names and shapes must match exactly
(loader/source.py has already checked the checkpoint against the config, in its own key names).
"""

from __future__ import annotations

import torch

from servescope.config import ModelConfig
from servescope.config.families import family
from servescope.errors import ModelLoadError
from servescope.loader import gguf_experts, gguf_packed
from servescope.model.linears.packed import QuantLinear
from servescope.model.decoder import CausalLM, local_rotary_for, rotary_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def materialize(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                max_positions: int | None = None, packed: dict | None = None) -> torch.nn.Module:
    """An uninitialised model of `cfg` on `device` in `dtype` (no float32 copy on the host first), with
    its rotary tables and tied weights in place; the caller fills the parameters. packed: a GGUF's blocks
    on `device`, whose modules (experts, projections, embedding, head) replace the float ones before
    anything is allocated."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions=max_positions)
    if packed:
        gguf_experts.packed_experts(model, packed)
        gguf_packed.apply_packed(model, packed, dtype)
    _allocate(model, device, dtype)
    model.tie_weights()  # every parameter was re-created: the head and the embedding are two again
    # non-persistent buffers (rotary tables) were built on meta: rebuild them on the device
    model.rotary = rotary_for(cfg, max_positions).to(device)
    local = local_rotary_for(cfg, max_positions)
    model.rotary_local = local.to(device) if local is not None else None
    return model


def _allocate(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace each meta parameter and buffer by an uninitialised tensor on `device`, floating ones in
    `dtype`. What `to_empty(device).to(dtype)` does, without the float32 copy of a bfloat16 model, and
    without `to_empty`'s first call through torch's Python meta decompositions (over a second of a
    start-up)."""
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:  # (packed experts: built on the device already)
                    continue
                new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                table[name] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else new


def build_model(cfg: ModelConfig, state_dict: dict, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None, packed: dict | None = None) -> torch.nn.Module:
    """packed: a GGUF's blocks (LoadedSource.packed), built into their modules before the float parameters
    are allocated (materialize); the build consumes the dict (a fused projection's parts are dropped once
    concatenated, so that the peak holds each block once).

    The checkpoint's names and shapes are checked whole on meta tensors first (nothing is read); then each
    layer's tensors are fused and copied into their parameters one layer at a time, so the build holds the
    model plus one layer's fused or stacked temporaries (an MoE layer's experts), whatever the
    checkpoint's dtype (safetensors' tensors are mapped from the files: loader/hf.py)."""
    packed = {} if packed is None else packed
    for k, v in packed.items():  # (in place: the build consumes the blocks, so that each is held once)
        packed[k] = tuple(x.to(device) if torch.is_tensor(x) else x for x in v)
    packed_keys = set(packed)
    model = materialize(cfg, device, dtype, max_positions, packed)
    expected = dict(model.named_parameters())  # tied: the head's weight is the embedding's, listed once
    sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")
          and k not in packed_keys}  # (packed: built on the blocks already, materialize)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    _check_names_and_shapes(model, cfg, {k: v.to("meta").as_subclass(_ShapeOnly) for k, v in sd.items()}, expected)
    with torch.no_grad():
        for part in _by_layer(sd, cfg.num_hidden_layers):
            for name, t in _fused(model, cfg, part).items():
                expected[name].copy_(t)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.refresh_bias()
    model.requires_grad_(False)
    return model.eval()


def _fused(model, cfg: ModelConfig, sd: dict) -> dict:
    """Checkpoint tensors -> the model's names (fused projections, stacked experts); Gemma's (1 + w) norms
    become plain ones, in float32 (a bfloat16 checkpoint's w + 1 rounded once, into the model's dtype)."""
    sd = model.fuse_checkpoint(sd, cfg.num_hidden_layers)
    offset = family(cfg.architecture).norm_offset
    if offset:
        sd = {k: v.float() + offset if k.endswith("norm.weight") else v for k, v in sd.items()}
    return sd


class _ShapeOnly(torch.Tensor):
    """A meta tensor whose torch.cat and torch.stack are worked out from the shapes alone. torch's meta
    kernels of those two are Python decompositions, and the first call of one imports torch._dynamo (and
    Triton): seconds of CPU in a process that builds a model without transformers having imported it
    already (a parallel worker, a CLI run). Every other op runs as on a plain meta tensor; inputs whose
    shapes do not join go to torch's own op, which raises its own error."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat or func is torch.stack:
            tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
            shape = _joined_shape([tuple(t.shape) for t in tensors], dim, func is torch.stack)
            if shape is not None and not kwargs.get("out"):
                dtype = tensors[0].dtype
                for t in tensors[1:]:
                    dtype = torch.promote_types(dtype, t.dtype)
                return torch.empty(shape, dtype=dtype, device="meta").as_subclass(cls)
        return super().__torch_function__(func, types, args, kwargs)


def _joined_shape(shapes: list, dim: int, new_dim: bool):
    """The shape of torch.cat (new_dim False) or torch.stack (True) of tensors of `shapes` along `dim`;
    None where they do not join (or the call is not one of those)."""
    if not shapes or any(len(s) != len(shapes[0]) for s in shapes):
        return None
    rank = len(shapes[0]) + new_dim
    if not isinstance(dim, int) or not -rank <= dim < rank:
        return None
    dim %= rank
    if new_dim:
        return (*shapes[0][:dim], len(shapes), *shapes[0][dim:]) if all(s == shapes[0] for s in shapes) else None
    rest = [s[:dim] + s[dim + 1:] for s in shapes]
    if any(r != rest[0] for r in rest):
        return None
    return (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1:])


def _check_names_and_shapes(model, cfg: ModelConfig, meta_sd: dict, expected: dict) -> None:
    sd = model.fuse_checkpoint(meta_sd, cfg.num_hidden_layers)  # (_fused's norm offsets change values only)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
    for name, p in expected.items():
        if tuple(sd[name].shape) != tuple(p.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(sd[name].shape)}, expected {tuple(p.shape)}")


def _by_layer(sd: dict, num_layers: int):
    """The state dict in parts: the tensors outside the layers, then each layer's (`model.layers.{i}.`)."""
    layers: list = [{} for _ in range(num_layers)]
    rest = {}
    for k, v in sd.items():
        i = _layer_index(k)
        (layers[i] if i is not None and i < num_layers else rest)[k] = v
    yield rest
    yield from layers


def _layer_index(key: str):
    if not key.startswith("model.layers."):
        return None
    head = key[len("model.layers."):].split(".", 1)[0]
    return int(head) if head.isdigit() else None
