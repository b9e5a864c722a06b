"""StepRecord: what one engine step did, what it cost, and what the cost model predicted."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class StepRecord:
    step: int
    start_time: float  # perf_counter seconds
    wall_seconds: float
    num_prefill_seqs: int
    num_decode_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    context_lens: list  # tokens in the cache per sequence after the step
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_usage: float  # referenced blocks / all blocks
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    # speculative decoding: requests that verified drafts this step, drafts scored, drafts accepted
    num_spec_seqs: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    grammar_mask_seconds: float = 0.0  # structured outputs: filling + applying the batch's token masks
    # bytes of the referenced KV blocks on rank 0 (K and V of every layer it holds: its KV heads, its pipeline
    # stage's layers; an int8 / fp8 cache's scales included): kv_bytes_used()
    kv_bytes_used: int = 0
    # from the cost model (None when prediction is off)
    predicted_seconds: Optional[float] = None
    flops: Optional[float] = None
    bytes: Optional[float] = None
    flops_by_group: dict = field(default_factory=dict)
    bytes_by_group: dict = field(default_factory=dict)
    bound: Optional[str] = None  # "compute" | "memory"
    hardware: Optional[str] = None
    # a tensor/pipeline-parallel engine: rank 0's seconds inside collectives this step (waiting for the
    # slowest rank included) and the bytes they carried; the rest of wall_seconds is compute and host
    comm_seconds: float = 0.0
    comm_bytes: int = 0
    predicted_comm_seconds: Optional[float] = None  # the cost model's collective time (in predicted_seconds)
    pipeline_micro_batches: int = 0  # a pipeline-parallel step: the micro-batches it was cut into (0: none)
    # a mixture-of-experts model (telemetry/moe.py): per sparse layer the distinct experts the step's tokens
    # were routed to, the tokens per expert summed over the sparse layers, max / mean tokens per expert
    # (averaged over the layers), the routed experts' bytes read, and the distinct experts per layer that
    # uniform routing would read (analysis/moe.py)
    moe_experts_active: list = field(default_factory=list)
    moe_tokens_per_expert: list = field(default_factory=list)
    moe_imbalance: Optional[float] = None
    moe_expert_bytes: int = 0
    moe_expected_experts: Optional[float] = None
    # expert parallelism (parallel/expert_parallel.py): the (token, expert) rows each rank's experts ran over the
    # step's sparse layers, their max / mean (1.0: every rank equally loaded), and rank 0's all-to-alls (in comm_*)
    moe_rows_per_rank: list = field(default_factory=list)
    moe_rank_imbalance: Optional[float] = None
    all_to_all_seconds: float = 0.0
    all_to_all_bytes: int = 0

    @property
    def compute_seconds(self) -> float:
        """wall_seconds less the time in collectives."""
        return max(0.0, self.wall_seconds - self.comm_seconds)

    @property
    def phase(self) -> str:
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode"

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def achieved_flops_per_s(self) -> Optional[float]:
        return None if self.flops is None or self.wall_seconds <= 0 else self.flops / self.wall_seconds

    @property
    def achieved_bytes_per_s(self) -> Optional[float]:
        return None if self.bytes is None or self.wall_seconds <= 0 else self.bytes / self.wall_seconds

    @property
    def prediction_error(self) -> Optional[float]:
        """(predicted - measured) / measured."""
        if self.predicted_seconds is None or self.wall_seconds <= 0:
            return None
        return (self.predicted_seconds - self.wall_seconds) / self.wall_seconds

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(phase=self.phase, compute_seconds=self.compute_seconds,
                 achieved_flops_per_s=self.achieved_flops_per_s,
                 achieved_bytes_per_s=self.achieved_bytes_per_s, prediction_error=self.prediction_error)
        return d


def step_period(records: list, i: int) -> float:
    """Seconds from record i's start to the next record's when the engine stepped again at once (the
    gap within twice the step's wall time: the outputs handed back and the requests added between two
    steps count), else record i's wall time."""
    r = records[i]
    if i + 1 < len(records):
        gap = records[i + 1].start_time - r.start_time
        if r.wall_seconds <= gap <= 2 * r.wall_seconds:
            return gap
    return r.wall_seconds


def kv_bytes_used(kv_manager, bytes_per_token: int) -> int:
    """StepRecord.kv_bytes_used: the tokens' worth of KV its used blocks hold (KVCacheManager.used_kv_tokens) times
    one token's bytes on rank 0 (the engine's shard config: its tensor-parallel KV heads, pipeline stage 0's
    layers; a simulated instance's analysis/kv_stages.rank0_kv_bytes_per_token). The engine and the simulator
    both report it so."""
    return int(kv_manager.used_kv_tokens() * bytes_per_token)
