"""The prefix-cache-aware router reads a hit as the engine takes one (KVCacheManager.get_computed_blocks): for a
hybrid model (a table per group of layers) the longest prefix every group can serve -- a windowed group the blocks
the next query reads -- not the full-attention group's leading run alone."""

from servescope.config import SamplingParams
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.prefix_cache import hash_full_blocks, max_hit_blocks
from servescope.scheduler.request import Request
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.spec import instance_spec
from servescope.sim.workload import SimRequest

from tiny_models import tiny_model_config

FIRST = tuple(range(1, 321))  # 20 blocks of 16
QUERY = FIRST + tuple(range(5000, 5040))  # a later turn: FIRST's blocks are its prefix


def _hybrid_spec():
    """Gemma 2's alternating layers with a 32-token window: the windowed group's pool is a few blocks a sequence."""
    cfg = tiny_model_config("gemma2", sliding_window=32, num_hidden_layers=4)
    return instance_spec(cfg, "h100", kv_cache_dtype="float32", cache=KVCacheConfig(num_kv_blocks=200),
                         batching=BatchingConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=1024),
                         link="none")


def _blocks(engine) -> tuple:
    """(the router's hit, the engine's hit, the full group's leading cached run) of QUERY, in blocks."""
    km = engine.kv_manager
    hashes = hash_full_blocks(QUERY, km.block_size, limit=max_hit_blocks(len(QUERY), km.block_size),
                              extend=km.extend_hashes)
    engine_hit = km.get_computed_blocks(Request("q", QUERY, SamplingParams(), 0.0))[1]
    return (Deployment.cached_prefix(engine, QUERY) // km.block_size, engine_hit // km.block_size,
            len(km.groups[0].cached_run(hashes)))


def test_the_router_reads_the_engines_hit_for_a_hybrid_model():
    spec = _hybrid_spec()
    dep = Deployment(spec, 2, "prefix")
    assert isinstance(dep.engines[0].kv_manager, HybridKVCacheManager)
    drive(dep, [SimRequest(0.0, FIRST, 4)])
    home = next(i for i in range(2) if dep.served_by(i))
    # just served: every group holds what a hit on FIRST's blocks needs
    router, engine, full_run = _blocks(dep.engines[home])
    assert router == engine == full_run == len(FIRST) // 16
    # other prompts on the same replica churn the windowed group's small pool: its blocks of FIRST are evicted while
    # the full group still holds the whole chain -- no hit for the engine, none for the router
    churn = [SimRequest(1.0 + i, tuple(range(1000 * (i + 1), 1000 * (i + 1) + 320)), 4) for i in range(3)]
    e = dep.engines[home]
    for r in churn:
        e.wait_until(r.arrival)
        e.add_request(f"c{r.arrival}", list(r.prompt), r.output_len, r.arrival)
        while e.has_unfinished():
            e.step()
    router, engine, full_run = _blocks(e)
    assert full_run == len(FIRST) // 16 and router == engine == 0
