"""The cost of communication: links (datasheet and measured) and the time of the collectives a
tensor- or pipeline-parallel step issues (pure functions, no torch).

Per collective (the alpha-beta model, Thakur et al. 2005; NCCL's ring):
    ring all-reduce over N ranks of B bytes: 2(N-1)/N x B / bandwidth + 2(N-1) x latency
    point-to-point of B bytes:               B / bandwidth + latency
`bandwidth` is one rank's bytes per second in one direction, `latency` a hop's fixed cost.

A tensor-parallel step (Megatron layout, parallel/tensor_parallel.py) all-reduces the [T, Dm]
activations twice per layer (after attention, after the MLP), once more after the vocabulary-parallel
embedding, and gathers the [B, V/Tp] logit shards; a pipeline-parallel step sends (h, residual)
[2, T, Dm] from each stage to the next and the logits [B, V] (float32) back to rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError

LOCAL_GLOO = "local-gloo"  # the link the local probe measures (parallel/link_probe.py)


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth: float  # bytes/s, per rank, per direction
    latency_s: float  # per hop
    source: str = ""
    notes: str = ""
    # measured all-reduce times ((bytes, seconds), ...) over `table_ranks` ranks, ascending: used in
    # place of the alpha-beta formula at that rank count (log-log interpolation between sizes), since a
    # CPU's all-reduce is not one straight line (in-cache sizes reduce several times faster)
    all_reduce_table: tuple = ()
    table_ranks: int = 0

    def __post_init__(self):
        if self.bandwidth <= 0 or self.latency_s < 0:
            raise InvalidParameterError("link", f"{self.name}: bandwidth must be > 0 and latency >= 0")
        sizes = [b for b, _ in self.all_reduce_table]
        if sizes != sorted(sizes) or any(t <= 0 or b <= 0 for b, t in self.all_reduce_table):
            raise InvalidParameterError("link", f"{self.name}: all_reduce_table must be ascending positive pairs")

    def table_seconds(self, num_bytes: float):
        """The measured all-reduce time at num_bytes (interpolated log-log; past the largest size at its
        bandwidth, below the smallest its time), or None without a table."""
        pts = self.all_reduce_table
        if not pts:
            return None
        if num_bytes <= pts[0][0]:
            return float(pts[0][1])
        if num_bytes >= pts[-1][0]:
            return float(pts[-1][1] * num_bytes / pts[-1][0])
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b0 <= num_bytes <= b1:
                f = math.log(num_bytes / b0) / math.log(b1 / b0)
                return float(math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0))))
        return None


LINKS = {link.name: link for link in [
    # NVIDIA H100 / H200 datasheets: "NVLink: 900GB/s" (NVLink 4, 18 links, both directions together),
    # so 450 GB/s per direction; through NVSwitch every GPU pair gets it. Latency per hop: 1 us, a
    # calibration, not a datasheet figure (a small all-reduce over 8 GPUs, 14 hops, then takes ~15 us,
    # the order NCCL's low-latency protocols reach); PCIe hops 5 us (through the host bridge).
    LinkSpec("nvlink4", 450e9, 1e-6, "NVIDIA H100/H200 SXM datasheets: NVLink 900 GB/s (bidirectional)",
             "H100-SXM, H200 with NVSwitch (DGX/HGX); NCCL reaches ~ 80% of this as bus bandwidth"),
    # PCI Express 4.0 x16: 16 GT/s x 16 lanes, 128b/130b -> 31.5 GB/s per direction; 5.0: 63 GB/s.
    LinkSpec("pcie4", 31.5e9, 5e-6, "PCI-SIG: PCIe 4.0 x16 = 16 GT/s x 16 lanes, 128b/130b, per direction",
             "GPUs without NVLink (L4, L40S, H100-PCIe without bridge) talk over the host's PCIe"),
    LinkSpec("pcie5", 63e9, 5e-6, "PCI-SIG: PCIe 5.0 x16 = 32 GT/s x 16 lanes, 128b/130b, per direction"),
]}

# the link a listed GPU uses between GPUs of one node by default
DEFAULT_LINK = {"H100-SXM": "nvlink4", "H200": "nvlink4", "A100-80GB": "nvlink4", "A100-40GB": "nvlink4",
                "H100-PCIe": "pcie5", "L4": "pcie4", "L40S": "pcie4", "RTX-4090": "pcie4", "MI300X": "pcie5"}


def all_reduce_seconds(num_bytes: float, ranks: int, link: LinkSpec) -> float:
    """Ring all-reduce of num_bytes over `ranks` (0 for one rank)."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    if link.all_reduce_table and ranks == link.table_ranks:
        return link.table_seconds(num_bytes)
    return 2 * (ranks - 1) / ranks * num_bytes / link.bandwidth + 2 * (ranks - 1) * link.latency_s


def gather_seconds(num_bytes_per_rank: float, ranks: int, link: LinkSpec) -> float:
    """Gather of each rank's num_bytes_per_rank on one rank (its link receives (N-1) shards)."""
    if ranks <= 1 or num_bytes_per_rank <= 0:
        return 0.0
    return (ranks - 1) * num_bytes_per_rank / link.bandwidth + (ranks - 1) * link.latency_s


def p2p_seconds(num_bytes: float, link: LinkSpec) -> float:
    return num_bytes / link.bandwidth + link.latency_s if num_bytes > 0 else 0.0


@dataclass(frozen=True)
class CommCost:
    """The collectives of one step on one rank: seconds and bytes, by kind."""

    all_reduce_seconds: float = 0.0
    gather_seconds: float = 0.0
    p2p_seconds: float = 0.0
    bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return self.all_reduce_seconds + self.gather_seconds + self.p2p_seconds


def step_comm_cost(cfg: ModelConfig, num_tokens: int, num_logits: int, tp: int, pp: int, link: LinkSpec,
                   act_bytes: int = 4) -> CommCost:
    """What a step of num_tokens tokens (num_logits rows sampled) spends in collectives at TP x PP."""
    if num_tokens <= 0:
        return CommCost()
    act = num_tokens * cfg.hidden_size * act_bytes  # one [T, Dm] activation
    # pipeline stages run one after another: the step's all-reduces are those of every stage
    n_reduce = 2 * cfg.num_hidden_layers + 1 if tp > 1 else 0
    shard_logits = num_logits * -(-cfg.vocab_size // tp) * 4
    ar = n_reduce * all_reduce_seconds(act, tp, link)
    ga = gather_seconds(shard_logits, tp, link)
    p2p = (pp - 1) * p2p_seconds(2 * act, link) + (p2p_seconds(num_logits * cfg.vocab_size * 4, link) if pp > 1 else 0.0)
    moved = n_reduce * act * (2 * (tp - 1) / tp if tp > 1 else 0) + (tp - 1) * shard_logits \
        + (pp - 1) * 2 * act + (num_logits * cfg.vocab_size * 4 if pp > 1 else 0)
    return CommCost(ar, ga, p2p, moved)


def get_link(name: str, local: "LinkSpec | None" = None) -> LinkSpec:
    """A datasheet link by name, or LOCAL_GLOO (the measured one, passed in as `local`)."""
    if name == LOCAL_GLOO:
        if local is None:
            raise InvalidParameterError("link", "the local gloo link has not been measured yet")
        return local
    if name not in LINKS:
        raise InvalidParameterError("link", f"unknown link {name!r}; known: {', '.join(list(LINKS) + [LOCAL_GLOO])}")
    return LINKS[name]


def fit_link(measured: dict, ranks: int, name: str = LOCAL_GLOO, source: str = "") -> LinkSpec:
    """The (latency, bandwidth) that best fit measured all-reduce times {bytes: seconds} over `ranks`
    in relative error (a least-squares fit weighted by 1/t^2, so that 8 KiB counts as much as 64 MiB),
    keeping the measured table itself for `ranks` ranks (LinkSpec.all_reduce_table)."""
    pts = sorted((float(b), float(t)) for b, t in measured.items() if t > 0)
    if len(pts) < 2:
        raise InvalidParameterError("link", "fitting a link needs all-reduce times at two sizes or more")
    f = 2 * (ranks - 1) / ranks
    # t = a * h + c * x with h = 2(N-1) hops, x = f * bytes; minimise sum ((a h + c x - t) / t)^2
    rows = [(2 * (ranks - 1) / t, f * b / t, 1.0) for b, t in pts]
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    y1 = sum(r[0] for r in rows)
    y2 = sum(r[1] for r in rows)
    det = s11 * s22 - s12 * s12
    lat = max(0.0, (y1 * s22 - y2 * s12) / det)
    inv_bw = (s11 * y2 - s12 * y1) / det
    if inv_bw <= 0:
        raise InvalidParameterError("link", f"all-reduce times do not grow with size: {pts}")
    return LinkSpec(name, 1.0 / inv_bw, lat, source or f"fitted to {len(pts)} measured all-reduce sizes",
                    all_reduce_table=tuple(pts), table_ranks=ranks)


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one tensor-parallel rank computes: H/T query heads, max(1, Hkv/T) KV heads, I/T MLP
    columns, ceil(V/T) vocabulary rows, every layer (pipeline stages run one after another)."""
    if tp == 1:
        return cfg
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=-(-cfg.vocab_size // tp))


# ------------------------------------------------------------------ the measured local link, cached
def link_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servescope" / "link.json"


def cached_local_link(key: str, path: Optional[Path] = None) -> Optional[LinkSpec]:
    """The local gloo link measured on this machine (`key`: its CPU and thread count), or None."""
    path = path or link_cache_path()
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None
    if not entry:
        return None
    return LinkSpec(**{**entry, "all_reduce_table": tuple(tuple(p) for p in entry["all_reduce_table"])})


def save_local_link(key: str, link: LinkSpec, path: Optional[Path] = None) -> None:
    path = path or link_cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache[key] = dataclasses.asdict(link)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))
