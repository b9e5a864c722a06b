"""`explain --tp T --pp P`: what splitting the model over T x P devices does to one workload's steps,
per phase: each rank's compute (the shard's roofline, analysis/collectives.shard_config), the
collectives (analysis/collectives.step_comm_cost), and the verdict: parallelism cuts the step, or
the link dominates.

A CPU spec is one machine: the T ranks of a stage run at once and share its cores and memory
bandwidth, so each rank's 1/T of the work takes as long as the whole did (TP over processes on one
CPU cannot cut the step; it only adds the collectives). On GPUs each rank is a device of the spec.
Pipeline stages (P > 1) divide each rank's weights and KV cache by P (each stage's KV pools as the
engine sizes them, a hybrid's stages holding different mixes of layer kinds: analysis/kv_stages.py); the
step time is the pipeline schedule of its micro-batches (analysis/pipeline_schedule.py: fill, the
bottleneck stage's work, its stalls, the hand-overs), as the engine cuts the step (`micro_batches`, 0: its
auto rule); one micro-batch runs the stages one after another. Tensor parallelism divides each layer's work by T and
adds 2L + 1 all-reduces of the step's activations plus the gather of the logits. On a CPU spec the
T x P ranks share the one machine (each rank's work at 1/(T x P) of it). Expert parallelism (--ep X, a
mixture of experts: X = T, or T = 1 with the attention replicated on X ranks) gives each rank 1/X of the
routed experts' rows and weights and adds, per sparse layer, the dispatch and combine all-to-alls and two
all-gathers (collectives.expert_parallel_cost), inside each pipeline stage at P > 1, and (at P = 1) the wait for
the busiest rank's experts (analysis/parallel_skew.py). A mixture at TP > 1
without EP shards each expert's width instead (vLLM's default; one all-reduce after each sparse layer).
"""

from __future__ import annotations

from typing import Optional

from servescope.analysis.collectives import LinkSpec, rank_weights_config, shard_config, step_comm_cost
from servescope.analysis.cost_model import step_cost
from servescope.analysis.hardware import HardwareSpec
from servescope.analysis.memory_planner import plan_memory
from servescope.analysis.op_counts import resolve_dtypes, weight_bytes
from servescope.analysis.parallel_skew import expert_wait_seconds
from servescope.analysis.pipeline_schedule import auto_micro_batches, pipelined_step
from servescope.config import ModelConfig
from servescope.config.moe import expert_layout_problem
from servescope.errors import InvalidParameterError


def _pipeline_phase(name: str, cfg: ModelConfig, seqs: list, num_logits: int, hw: HardwareSpec, link: LinkSpec,
                    tp: int, pp: int, dtypes: tuple, micro_batches: int, ep: int = 1) -> dict:
    """A phase at P > 1: the schedule with the engine's micro-batches beside one micro-batch."""
    wdt, kdt, adt, _ = dtypes
    single = step_cost(cfg, seqs, hw, wdt, kdt, adt, num_logits=num_logits).predicted_seconds
    share = max(tp, ep) * pp if hw.kind == "cpu" else 1
    m = auto_micro_batches(sum(n for n, _ in seqs if n > 1), pp, micro_batches)
    step = pipelined_step(cfg, seqs, hw, tp, pp, m, link, dtypes, share, num_logits, ep)
    whole = pipelined_step(cfg, seqs, hw, tp, pp, 1, link, dtypes, share, num_logits, ep)
    sched, total = step.schedule, step.step_seconds
    compute = max(sum(row) for row in zip(*step.compute_only)) + step.head_seconds  # the busiest stage
    reduces = step.comm_seconds - sched.p2p_seconds - step.logits_seconds
    return {"name": name, "single_device_seconds": single, "compute_seconds": compute,
            "all_reduce_seconds": reduces, "gather_seconds": 0.0,
            "p2p_seconds": sched.p2p_seconds + step.logits_seconds, "comm_seconds": step.comm_seconds,
            "comm_bytes": step_comm_cost(cfg, sum(n for n, _ in seqs), num_logits, tp, pp, link, dtypes[3]).bytes,
            "step_seconds": total, "speedup": single / total if total else None,
            "comm_share": step.comm_seconds / total if total else 0.0,
            "link_dominates": step.comm_seconds > compute,
            "pipeline": {"micro_batches": sched.num_micro_batches, "fill_seconds": sched.fill_seconds,
                         "stall_seconds": sched.stall_seconds, "bubble_fraction": sched.bubble_fraction,
                         "stage_busy_seconds": list(sched.busy_seconds), "handover_seconds": sched.p2p_seconds,
                         "one_micro_batch_step_seconds": whole.step_seconds,
                         "overlap_speedup": whole.step_seconds / total if total else None}}


def _phase(name: str, cfg: ModelConfig, seqs: list, num_logits: int, hw: HardwareSpec, link: LinkSpec,
           tp: int, pp: int, dtypes: tuple, micro_batches: int = 0, ep: int = 1) -> dict:
    if pp > 1:
        return _pipeline_phase(name, cfg, seqs, num_logits, hw, link, tp, pp, dtypes, micro_batches, ep)
    wdt, kdt, adt, act_bytes = dtypes
    single = step_cost(cfg, seqs, hw, wdt, kdt, adt, num_logits=num_logits).predicted_seconds
    compute = step_cost(shard_config(cfg, tp, ep), seqs, hw, wdt, kdt, adt, num_logits=num_logits,
                        expert_parallel=ep).predicted_seconds
    # expert parallelism: each sparse layer waits for the busiest rank's experts (analysis/parallel_skew.py)
    wait = expert_wait_seconds(shard_config(cfg, tp, ep), seqs, hw, (wdt, kdt, adt), ep, num_logits,
                               desync=link.desync)
    if hw.kind == "cpu":  # one machine: its busy ranks share the cores and the memory bandwidth it has
        compute, wait = compute * max(tp, ep), wait * max(tp, ep)
    comm = step_comm_cost(cfg, sum(n for n, _ in seqs), num_logits, tp, pp, link, act_bytes, ep)
    total = compute + comm.seconds + wait
    return {"name": name, "single_device_seconds": single, "compute_seconds": compute,
            "all_reduce_seconds": comm.all_reduce_seconds, "gather_seconds": comm.gather_seconds,
            "all_to_all_seconds": comm.all_to_all_seconds, "expert_wait_seconds": wait,
            "p2p_seconds": comm.p2p_seconds, "comm_seconds": comm.seconds, "comm_bytes": comm.bytes,
            "step_seconds": total, "speedup": single / total if total else None,
            "comm_share": comm.seconds / total if total else 0.0,
            "link_dominates": comm.seconds > compute}


def explain_parallel(cfg: ModelConfig, hw: HardwareSpec, link: LinkSpec, tp: int, pp: int, batch: int = 1,
                     prompt_len: int = 512, output_len: int = 128, weight_dtype: str = "bfloat16",
                     kv_dtype: Optional[str] = None, act_dtype: Optional[str] = None,
                     micro_batches: int = 0, ep: int = 1) -> dict:
    """The parallel account of `explain`'s workload (the same phases: one prefill step of every
    prompt, the decode step at the middle context); micro_batches: a pipeline step's (0: auto); ep: the
    expert-parallel ranks of a mixture of experts."""
    if tp < 1 or pp < 1:
        raise InvalidParameterError("tp", f"tp and pp must be >= 1, got {tp}, {pp}")
    if cfg.num_attention_heads % tp or pp > cfg.num_hidden_layers:
        raise InvalidParameterError("tp", f"TP={tp} must divide the {cfg.num_attention_heads} heads and PP={pp} "
                                          f"be at most the {cfg.num_hidden_layers} layers")
    problem = expert_layout_problem(cfg.moe, tp, ep)  # MoE layouts: the rule of config/moe.py
    if problem:
        raise InvalidParameterError("ep", problem)
    wdt, adt, kdt = resolve_dtypes(weight_dtype, act_dtype, kv_dtype)
    dtypes = (wdt, kdt, adt, {"float32": 4}.get(adt, 2))
    mid = prompt_len + max(output_len - 2, 0) // 2
    phases = [_phase("prefill", cfg, [(prompt_len, 0)] * batch, batch, hw, link, tp, pp, dtypes, micro_batches, ep)]
    if output_len > 1:
        phases.append(_phase("decode", cfg, [(1, mid)] * batch, batch, hw, link, tp, pp, dtypes, micro_batches, ep))
    shard = rank_weights_config(cfg, tp, ep)
    # one rank's memory: its shard of its stage's layers (the embedding and head counted on every rank, a slight
    # over-count for P > 1); the blocks sized from stage 0's layers, each stage's pools as the engine allocates
    # them (analysis/kv_stages.py: a hybrid's stages hold different mixes of kinds)
    kw = dict(context_len=prompt_len + output_len, act_dtype=adt, max_num_batched_tokens=max(prompt_len * batch, 16),
              max_num_seqs=batch)
    single_plan = plan_memory(cfg, hw.memory_bytes, wdt, kdt, **kw)
    rank_plan = plan_memory(shard, hw.memory_bytes, wdt, kdt, pp=pp, **kw)
    return {
        "tp": tp, "pp": pp, "ep": ep,
        "link": {"name": link.name, "bandwidth": link.bandwidth, "latency_s": link.latency_s, "source": link.source},
        "weight_bytes_per_rank": weight_bytes(shard, wdt, adt) / pp,
        "kv_cache_bytes_per_token_per_rank": rank_plan.kv_bytes_per_token,
        "max_concurrent_sequences": rank_plan.max_concurrent_sequences,
        "max_concurrent_sequences_per_group_tables": rank_plan.max_concurrent_sequences_per_group_tables,
        "max_concurrent_sequences_one_device": single_plan.max_concurrent_sequences,
        "kv_stages": rank_plan.to_dict()["stages"], "kv_binding_stage": rank_plan.binding_stage,
        "kv_num_blocks": rank_plan.num_kv_blocks, "kv_block_size": rank_plan.block_size,
        "phases": phases,
        "verdict": verdict(phases, tp, pp, link.name, ep),
    }


def verdict(phases: list, tp: int, pp: int, link: str, ep: int = 1) -> str:
    """One sentence per phase: does T x P cut the step, or does the link dominate it?"""
    out = []
    layout = f"TP={tp} x PP={pp}" + (f" with EP={ep}" if ep > 1 else "")
    for p in phases:
        change = "cuts" if p["speedup"] and p["speedup"] > 1 else "lengthens"
        why = (f"the link dominates: collectives {p['comm_share']:.0%} of the step" if p["link_dominates"]
               else f"compute per rank dominates; collectives {p['comm_share']:.0%} of the step")
        out.append(f"{p['name']}: {layout} over {link} {change} the step "
                   f"{p['single_device_seconds'] * 1e3:.3g} ms -> {p['step_seconds'] * 1e3:.3g} ms "
                   f"({p['speedup']:.2f}x); {why}" + _pipeline_note(p.get("pipeline")))
    return ". ".join(out)


def _pipeline_note(pipe: Optional[dict]) -> str:
    if not pipe:
        return ""
    if pipe["micro_batches"] == 1:
        return "; one micro-batch: the stages run one after another"
    return (f"; {pipe['micro_batches']} micro-batches overlap the stages (fill {pipe['fill_seconds'] * 1e3:.3g} ms, "
            f"{pipe['bubble_fraction']:.0%} of stage time idle): {pipe['overlap_speedup']:.2f}x one micro-batch's "
            f"{pipe['one_micro_batch_step_seconds'] * 1e3:.3g} ms")
