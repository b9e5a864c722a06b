"""Where an MoE model's decode step goes: the C++ kernels against everything else (issue 37).

Every entry point of the CPU op extension (the packed GEMVs, the fused experts' op, attention, norms,
silu) is wrapped in a timer; a decode step's wall time minus the time inside them is the host work that moves
no packed weights: Python, module dispatch, the routers' small torch ops, sampling. Run on a GGUF of a real
MoE shape (benchmarks/moe_real_shape.py's file), with its own blocks (--quantization gguf); steps are driven
one at a time after a warm-up, and medians over the decode steps at the full batch are printed. The timers
cost ~1 us a call, counted in the "other" share. Works on any tree with the extension (PYTHONPATH picks it),
so the same command compares two trees.

    PYTHONPATH=src python benchmarks/moe_step_profile.py --gguf DIR/gguf/olmoe-1b-7b-Q4_0.gguf --threads 2 \
        [--batches 1,4,16] [--steps 48]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

TIMES: dict = defaultdict(float)  # entry point -> seconds since the last reset


def _timed(name: str, fn):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
    return call


class _TimedHandle:
    """A C++ handle (the fused experts' op) whose `run` is timed."""

    def __init__(self, handle):
        self._handle = handle
        self.run = _timed("moe_packed", handle.run)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def install_timers() -> None:
    from servescope.kernels.cpu import ops as cpu_ops  # (torch)

    mod = cpu_ops.load()
    for name in dir(mod):
        fn = getattr(mod, name)
        if name.startswith("_") or not callable(fn) or name == "DecodePlan":
            continue
        if isinstance(fn, type):  # MoePacked: its handles' run
            setattr(mod, name, lambda *a, _cls=fn: _TimedHandle(_cls(*a)))
        else:
            setattr(mod, name, _timed(name, fn))


def profile_batch(llm, batch: int, steps: int) -> dict:
    from servescope import SamplingParams  # (torch)

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"p{batch}-{steps}-{i}", [5 + (i * 7 + j) % 200 for j in range(16)], params)
    rows = []
    while eng.has_unfinished():
        TIMES.clear()
        eng.step()
        rec = eng.step_records[-1]
        if rec.phase == "decode" and rec.num_decode_seqs == batch:
            rows.append((rec.wall_seconds, sum(TIMES.values()), TIMES.get("moe_packed", 0.0),
                         TIMES.get("quant_gemv", 0.0)))
    step, kern, moe, qg = (statistics.median(r[i] for r in rows) for i in range(4))
    return {"decode_steps": len(rows), "step_ms": 1e3 * step, "cpp_kernels_ms": 1e3 * kern,
            "fused_moe_ms": 1e3 * moe, "quant_gemv_ms": 1e3 * qg, "other_ms": 1e3 * (step - kern),
            "other_share": (step - kern) / step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    import torch  # (the engine half)

    from servescope.engine.llm import LLM  # (torch)

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.gguf, quantization="gguf", num_threads=args.threads, max_num_seqs=max(batches),
              max_model_len=1024)
    install_timers()
    profile_batch(llm, 1, 4)  # warm-up
    for b in batches:
        r = profile_batch(llm, b, args.steps)
        print(f"batch {b}: step {r['step_ms']:.1f} ms, C++ kernels {r['cpp_kernels_ms']:.1f} ms (fused experts "
              f"{r['fused_moe_ms']:.1f}, packed GEMVs {r['quant_gemv_ms']:.1f}), other {r['other_ms']:.1f} ms = "
              f"{100 * r['other_share']:.0f}% of the step ({r['decode_steps']} steps)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
