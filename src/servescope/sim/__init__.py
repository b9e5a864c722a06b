"""servescope.sim: the engine's own scheduler and KV cache manager on a virtual clock, step times from the
cost model; single engines, data-parallel replicas behind a router, prefill/decode disaggregation."""
