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

An expert-parallel step over N ranks (parallel/expert_parallel.py) adds per sparse layer: the tokens per
expert all-gathered ([N, E] int64), the dispatch and the combine all-to-alls (each rank's slice of
Tr = ceil(T/N) tokens as Tr k rows [Dm], of which (N-1)/N leave it under uniform routing), and the slices'
outputs all-gathered ([N Tr, Dm]); with tensor-parallel attention its sparse layers all-reduce only a shared
expert's output. Every parallel step (TP, PP, EP) also starts with rank 0 broadcasting its step plan
(parallel/plan.py: a header, then the payload of int64s), two broadcasts the other ranks wait in.
An all-to-all, an all-gather and the plan are priced from their own measurement where the link has one (the
local gloo link: parallel/link_probe.measure_step_collectives, each a call's cost + bytes / its rate, the plan
one figure), else as pairwise exchange (bytes sent / bandwidth + (N-1) x latency), the ring ((N-1) x (bytes
per rank / bandwidth + latency)) and a binomial tree of ceil(log2 N) hops per broadcast. The local link's
are measured as a step issues them: the plan after rank 0's own work with the others waiting in it, then
sparse layers of compute on every rank, the tokens-per-expert all-gather, the dispatch at once after it,
compute, the combine and the outputs' all-gather at once after it. A call that follows another call costs
more than one after compute (gloo between processes: the first rank out is already waiting in the next call
while the last one is still being woken from the first), and the back-to-back all-reduces of the ring fit
pay neither the wake-up of a waiting peer nor that. What a rank's collectives also hold, waiting for the
slower rank, is priced apart (analysis/parallel_skew.py: the busiest rank's experts over the mean rank's).
Against vLLM's all-reduce of [T, Dm] partial sums (its TP + EP without data parallelism), the all-to-alls move
(N-1)/N T Dm (2k/N + 1) bytes per rank to the all-reduce's 2 (N-1)/N T Dm: more at N = 2 for k >= 2 (1.5x at
k = 2), less once N > 2k.

The local link (gloo between processes of one machine, measured by parallel/link_probe.py) is not an
alpha-beta line: torch's ProcessGroupGloo runs gloo's ring all-reduce (gloo/allreduce.cc, `ring`), which
cuts the buffer into S = roundUp(max(ceil(B / 1 MiB), 2N), N) segments (gloo's kMaxSegmentSize is 1 MiB;
at least two segments per rank so that one is in flight while the other is reduced) and runs
S - S/N steps of reduce-scatter then as many of all-gather, each step one segment sent to one
neighbour while one arrives from the other. Over TCP (gloo's transport between local processes) a
segment's first bytes, up to the socket's receive buffer C, are written without waiting for the peer;
the rest wait for it to read. So with
steps = 2 (S - S/N) and seg = 2 (N-1)/N x B / steps bytes per step, its time is
    call_s + steps x step_s + steps x min(seg, C) / buffered_bandwidth + steps x max(0, seg - C) / bandwidth
call_s: once per all-reduce (the process group's worker thread taking the work and handing it back);
step_s: per ring step (system calls, the transport thread's wake-up on the arriving segment);
buffered_bandwidth: the bytes that go into the socket buffer (copies, the reduction); bandwidth: the
bytes streamed while the peer drains it. Two regime changes: up to 2N MiB (4 MiB at N = 2) every
all-reduce takes 4(N-1) steps whatever its size, above it one more per MiB and phase; segments up to
C (128 KiB here: all-reduces up to 4C at N = 2) never wait on the peer's reads. The probe reads C
from the kernel (parallel/link_probe.socket_buffer_bytes) and fits the four rates to its measured
sizes (analysis/link_fit.fit_link); the datasheet links keep the alpha-beta formula above.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError
from servescope.analysis.cache_dir import cache_dir

LOCAL_GLOO = "local-gloo"  # the link the local probe measures (parallel/link_probe.py)
GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's AllreduceOptionsImpl::kMaxSegmentSize (ProcessGroupGloo keeps it)


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth: float  # bytes/s, per rank, per direction
    latency_s: float  # per hop (a measured gloo link: one collective of one message, call_s + step_s)
    source: str = ""
    notes: str = ""
    # a measured gloo link (max_segment_bytes > 0): its all-reduce is gloo's segmented ring (the module
    # docstring), at any rank count; 0: a datasheet link, the alpha-beta ring
    call_s: float = 0.0  # per all-reduce
    step_s: float = 0.0  # per ring step (one segment out to one neighbour, one in from the other)
    max_segment_bytes: int = 0
    buffer_bytes: int = 0  # C: a segment's bytes up to it go into the socket buffer (0: none modelled)
    buffered_bandwidth: float = 0.0  # of those bytes (0: free, the fit found no cost)
    # measured as a parallel step issues them (link_fit.fit_step_collectives); 0: priced from latency_s and
    # bandwidth (a datasheet link). The all-to-all: a2a_call_s + bytes sent / a2a_bandwidth; the all-gather: per
    # ring step ag_call_s + one rank's bytes / ag_bandwidth; the step plan's two broadcasts: plan_s + its bytes
    # at the all-to-all's rate
    a2a_call_s: float = 0.0
    a2a_bandwidth: float = 0.0
    ag_call_s: float = 0.0
    ag_bandwidth: float = 0.0
    plan_s: float = 0.0
    # the spread (sd / mean) of one rank's time for the same memory-bound work while the other ranks run theirs
    # (link_probe's step probe; 0: not measured): what each rank waits for at a sync beyond the routing's skew
    # (analysis/parallel_skew.expert_wait_seconds)
    desync: float = 0.0

    def __post_init__(self):
        if self.bandwidth <= 0 or min(self.latency_s, self.call_s, self.step_s, self.max_segment_bytes,
                                      self.buffer_bytes, self.buffered_bandwidth, self.a2a_call_s,
                                      self.a2a_bandwidth, self.ag_call_s, self.ag_bandwidth, self.plan_s,
                                      self.desync) < 0:
            raise InvalidParameterError("link", f"{self.name}: bandwidth must be > 0, latencies and the segment >= 0")


    def describe(self) -> str:
        """One line: the link's terms."""
        if self.max_segment_bytes:
            buffered = f"{self.buffered_bandwidth / 1e9:.2f} GB/s" if self.buffered_bandwidth else "free"
            a2a = (f"; all-to-all {self.a2a_call_s * 1e6:.0f} us per call + bytes at {self.a2a_bandwidth / 1e9:.2f} "
                   f"GB/s, all-gather {self.ag_call_s * 1e6:.0f} us + bytes at {self.ag_bandwidth / 1e9:.2f} GB/s, "
                   f"step plan {self.plan_s * 1e6:.0f} us (as a step issues them)" if self.a2a_bandwidth else "")
            a2a += f"; ranks' equal work spread {100 * self.desync:.1f}%" if self.desync else ""
            return (f"{self.name}: gloo ring, {self.call_s * 1e6:.0f} us per all-reduce + {self.step_s * 1e6:.0f} us "
                    f"per step; a segment's first {self.buffer_bytes // 1024} KiB {buffered}, the rest "
                    f"{self.bandwidth / 1e9:.2f} GB/s{a2a}")
        return f"{self.name}: {self.bandwidth / 1e9:.3g} GB/s, {self.latency_s * 1e6:.3g} us per hop"


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
    # NVIDIA ConnectX-7 datasheet: InfiniBand NDR 400 Gb/s per port = 50 GB/s per direction; a DGX/HGX H100
    # node has one port per GPU. Between nodes (prefill/decode disaggregation's KV transfer); the 5 us per
    # message is a calibration (RDMA write latency is a few us), not a datasheet figure.
    LinkSpec("ib-ndr400", 50e9, 5e-6, "NVIDIA ConnectX-7 datasheet: 400 Gb/s InfiniBand NDR per port",
             "one port per GPU between nodes (GPUDirect RDMA)"),
]}

# the link a listed GPU uses between GPUs of one node by default
DEFAULT_LINK = {"H100-SXM": "nvlink4", "H200": "nvlink4", "A100-80GB": "nvlink4", "A100-40GB": "nvlink4",
                "H100-PCIe": "pcie5", "L4": "pcie4", "L40S": "pcie4", "RTX-4090": "pcie4", "MI300X": "pcie5"}


def ring_steps(num_bytes: float, ranks: int, max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES,
               element_bytes: int = 4) -> int:
    """The steps of one phase (reduce-scatter, or all-gather) of gloo's ring all-reduce of num_bytes over
    `ranks`: S - S/N for its S = roundUp(max(ceil(B / max segment), 2N), N) segments."""
    max_seg = element_bytes * max(1, max_segment_bytes // element_bytes)
    n = -(-max(-(-int(num_bytes) // max_seg), 2 * ranks) // ranks) * ranks
    return n - n // ranks


def ring_terms(num_bytes: float, ranks: int, max_segment_bytes: int, buffer_bytes: int = 0) -> tuple:
    """(1, ring steps, bytes buffered, bytes streamed) of one rank's all-reduce: what call_s, step_s,
    1 / buffered_bandwidth and 1 / bandwidth multiply (the fit's columns and the prediction's)."""
    steps = 2.0 * ring_steps(num_bytes, ranks, max_segment_bytes)
    sent = 2 * (ranks - 1) / ranks * num_bytes
    buffered = steps * min(sent / steps, buffer_bytes)
    return 1.0, steps, buffered, sent - buffered


def all_reduce_seconds(num_bytes: float, ranks: int, link: LinkSpec) -> float:
    """Ring all-reduce of num_bytes over `ranks` (0 for one rank): gloo's segmented ring on a measured
    link, the alpha-beta ring on a datasheet one."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    if link.max_segment_bytes:
        one, steps, buffered, streamed = ring_terms(num_bytes, ranks, link.max_segment_bytes, link.buffer_bytes)
        return (one * link.call_s + steps * link.step_s + streamed / link.bandwidth
                + (buffered / link.buffered_bandwidth if link.buffered_bandwidth else 0.0))
    return 2 * (ranks - 1) / ranks * num_bytes / link.bandwidth + 2 * (ranks - 1) * link.latency_s


def gather_seconds(num_bytes_per_rank: float, ranks: int, link: LinkSpec) -> float:
    """Gather of each rank's num_bytes_per_rank on one rank (its link receives (N-1) shards)."""
    if ranks <= 1 or num_bytes_per_rank <= 0:
        return 0.0
    return (ranks - 1) * num_bytes_per_rank / link.bandwidth + (ranks - 1) * link.latency_s


def p2p_seconds(num_bytes: float, link: LinkSpec) -> float:
    return num_bytes / link.bandwidth + link.latency_s if num_bytes > 0 else 0.0


def all_to_all_seconds(bytes_sent: float, ranks: int, link: LinkSpec) -> float:
    """One rank's all-to-all, bytes_sent to the other ranks. A link whose all-to-all was measured
    (a2a_bandwidth > 0, two ranks): one call's cost + the bytes at its rate (gloo's alltoallv posts the N - 1
    sends together, so more ranks add bytes, not calls); else pairwise exchange, N - 1 messages of latency_s."""
    if ranks <= 1:
        return 0.0
    if link.a2a_bandwidth:
        return link.a2a_call_s + bytes_sent / link.a2a_bandwidth
    return bytes_sent / link.bandwidth + (ranks - 1) * link.latency_s


def all_gather_seconds(bytes_per_rank: float, ranks: int, link: LinkSpec) -> float:
    """Ring all-gather of each rank's bytes_per_rank: N - 1 steps of one rank's part, each one exchange with the
    neighbours: on a link whose all-gather was measured, as measured (its call's cost + the bytes at its rate: at
    N = 2 the one step), else latency_s + the bytes."""
    if ranks <= 1:
        return 0.0
    if link.ag_bandwidth:
        return (ranks - 1) * (link.ag_call_s + bytes_per_rank / link.ag_bandwidth)
    return (ranks - 1) * (bytes_per_rank / link.bandwidth + link.latency_s)


def plan_bytes(num_tokens: int, num_logits: int, header_ints: int = 9) -> float:
    """The bytes of a step plan (parallel/plan.py, int64s): the header, then per token its id, position and KV
    slot, per sampled row its context length, query start and logits row, one more query start. A step's
    sequences are counted as its sampled rows (a prefill chunk that samples nothing sends its two ints less)
    and the block tables are left out (a few ints per sequence at short contexts)."""
    return 8.0 * (header_ints + 3 * num_tokens + 3 * num_logits + 1)


def plan_seconds(num_bytes: float, ranks: int, link: LinkSpec) -> float:
    """Rank 0's broadcasts of a step plan of num_bytes (the header's and the payload's) to the other ranks: on a
    link that measured them, plan_s + the bytes at its all-to-all's rate (measured at two ranks: rank 0 posts one
    send per other rank, so more ranks add bytes); else a binomial tree's ceil(log2 N) hops per broadcast."""
    if ranks <= 1:
        return 0.0
    if link.plan_s:
        return link.plan_s + (ranks - 1) * num_bytes / (link.a2a_bandwidth or link.bandwidth)
    return math.ceil(math.log2(ranks)) * (2 * link.latency_s + num_bytes / link.bandwidth)


@dataclass(frozen=True)
class CommCost:
    """The collectives of one step on one rank: seconds and bytes, by kind (an expert-parallel step's
    all-gathers in gather_seconds, its dispatch and combine in all_to_all_seconds; the step plan's broadcasts in
    plan_seconds)."""

    all_reduce_seconds: float = 0.0
    gather_seconds: float = 0.0
    p2p_seconds: float = 0.0
    bytes: float = 0.0
    all_to_all_seconds: float = 0.0
    plan_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.all_reduce_seconds + self.gather_seconds + self.p2p_seconds + self.all_to_all_seconds
                + self.plan_seconds)


def expert_parallel_cost(cfg: ModelConfig, num_tokens: int, ep: int, link: LinkSpec, act_bytes: int = 4) -> tuple:
    """(all-to-all seconds, all-gather seconds, bytes sent) of one rank over a step's sparse layers at EP = N,
    rank 0's share (the largest slice) under uniform routing."""
    if ep <= 1 or cfg.moe is None or num_tokens <= 0:
        return 0.0, 0.0, 0.0
    sparse, e = cfg.moe.num_sparse(cfg.num_hidden_layers), cfg.moe.experts
    mine = -(-num_tokens // ep)  # Tr
    rows = mine * cfg.hidden_size * act_bytes  # one slice [Tr, Dm]
    sent = rows * e.top_k * (ep - 1) / ep  # the dispatch's rows to the other ranks (the combine's likewise)
    counts = e.num_experts * 8
    a2a = sparse * 2 * all_to_all_seconds(sent, ep, link)
    gathers = sparse * (all_gather_seconds(counts, ep, link) + all_gather_seconds(rows, ep, link))
    return a2a, gathers, sparse * (2 * sent + (ep - 1) * (counts + rows))


def step_comm_cost(cfg: ModelConfig, num_tokens: int, num_logits: int, tp: int, pp: int, link: LinkSpec,
                   act_bytes: int = 4, ep: int = 1) -> CommCost:
    """What a step of num_tokens tokens (num_logits rows sampled) spends in collectives at TP x PP (EP: the
    experts over the tensor-parallel ranks, or over ranks of replicated attention at TP = 1)."""
    if num_tokens <= 0:
        return CommCost()
    act = num_tokens * cfg.hidden_size * act_bytes  # one [T, Dm] activation
    # pipeline stages run one after another: the step's all-reduces are those of every stage; an
    # expert-parallel sparse layer all-reduces only its shared expert's output
    L = cfg.num_hidden_layers
    sparse = cfg.moe.num_sparse(L) if cfg.moe is not None and ep > 1 else 0
    after_mlp = L - sparse + (sparse if sparse and cfg.moe.experts.shared_intermediate_size else 0)
    n_reduce = L + after_mlp + 1 if tp > 1 else 0
    shard_logits = num_logits * -(-cfg.vocab_size // tp) * 4
    ar = n_reduce * all_reduce_seconds(act, tp, link)
    ga = gather_seconds(shard_logits, tp, link)
    logits = p2p_seconds(num_logits * cfg.vocab_size * 4, link) if pp > 1 else 0.0
    p2p = (pp - 1) * p2p_seconds(2 * act, link) + logits
    a2a, ep_gathers, ep_bytes = expert_parallel_cost(cfg, num_tokens, ep, link, act_bytes)
    world = max(tp, ep) * pp  # (parallel/layout.py: a stage's ranks are its TP shards or its EP ranks)
    plan = plan_bytes(num_tokens, num_logits)
    moved = n_reduce * act * (2 * (tp - 1) / tp if tp > 1 else 0) + (tp - 1) * shard_logits \
        + (pp - 1) * 2 * act + (num_logits * cfg.vocab_size * 4 if pp > 1 else 0) + ep_bytes \
        + (world - 1) * plan
    return CommCost(ar, ga + ep_gathers, p2p, moved, a2a, plan_seconds(plan, world, link))


def get_link(name: str, local: "LinkSpec | None" = None) -> LinkSpec:
    """A datasheet link by name, or LOCAL_GLOO (the measured one, passed in as `local`)."""
    if name == LOCAL_GLOO:
        if local is None:
            raise InvalidParameterError("link", "the local gloo link has not been measured yet")
        return local
    if name not in LINKS:
        raise InvalidParameterError("link", f"unknown link {name!r}; known: {', '.join(list(LINKS) + [LOCAL_GLOO])}")
    return LINKS[name]


def shard_config(cfg: ModelConfig, tp: int, ep: int = 1) -> ModelConfig:
    """The model one tensor-parallel rank computes: H/T query heads, max(1, Hkv/T) KV heads, I/T MLP
    columns (a mixture's shared expert's too; its routed experts: under expert parallelism (ep > 1) split
    whole over the ranks, priced by step_cost's expert_parallel, else I/T of each expert's width), ceil(V/T)
    vocabulary rows, every layer (pipeline stages run one after another)."""
    if tp == 1:
        return cfg
    moe = cfg.moe
    if moe is not None:
        e = moe.experts
        width = e.intermediate_size // tp if ep == 1 else e.intermediate_size
        moe = dataclasses.replace(moe, experts=dataclasses.replace(
            e, intermediate_size=width, shared_intermediate_size=e.shared_intermediate_size // tp))
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=-(-cfg.vocab_size // tp),
                               moe=moe)


def rank_weights_config(cfg: ModelConfig, tp: int, ep: int = 1) -> ModelConfig:
    """What one rank holds, for its weights and memory: its tensor-parallel shard (shard_config) with, under
    expert parallelism, E/X of the routed experts (the replicated router counted at E/X rows: a slight
    under-count)."""
    shard = shard_config(cfg, tp, ep)
    if ep == 1 or shard.moe is None:
        return shard
    e = shard.moe.experts
    mine = e.num_experts // ep
    experts = dataclasses.replace(e, num_experts=mine, top_k=min(e.top_k, mine), n_group=1, topk_group=1)
    return dataclasses.replace(shard, moe=dataclasses.replace(shard.moe, experts=experts))


# ------------------------------------------------------------------ the measured local link, cached
def link_cache_path() -> Path:
    return cache_dir() / "link.json"


def kv_send_key(key: str) -> str:
    """The cache key of the KV send path's link (measure/kv_send.py) on the machine of local link key `key`:
    a point-to-point hand-over, not the all-reduce ring cached under `key` itself."""
    return f"{key} / kv send"


def cached_local_link(key: str, path: Optional[Path] = None) -> Optional[LinkSpec]:
    """The local gloo link measured on this machine (`key`: its CPU and thread count), or None."""
    path = path or link_cache_path()
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None
    if not entry:
        return None
    try:  # an entry of an older model (another set of terms) is re-measured, not misread
        return LinkSpec(**entry)
    except (TypeError, InvalidParameterError):
        return None


def save_local_link(key: str, link: LinkSpec, path: Optional[Path] = None) -> None:
    path = path or link_cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache[key] = dataclasses.asdict(link)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache, indent=1))
