"""Where does a prefill-heavy batch spend its time on the GPU? (diagnostic for benchmarks/gpu.py)

Runs random-weight Llama-3-8B (bf16) on 64 prompts of 128..512 tokens, 16 new tokens each, prints
every step's phase, tokens, wall time and predicted time, then a torch.profiler table of one
prefill step and one decode step.
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "src")
from servescope import LLM, SamplingParams  # noqa: E402


def main():
    llm = LLM(model="random:llama-3-8b", dtype="bfloat16", device="cuda", max_num_seqs=256,
              max_num_batched_tokens=8192, max_model_len=1024, kv_cache_memory_bytes=40 << 30)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (int(torch.randint(128, 513, (1,), generator=g)),), generator=g).tolist()
               for _ in range(64)]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts[:4], p)  # warm-up
    n0 = len(eng.step_records)
    t = time.perf_counter()
    llm.generate(prompts, p)
    print(f"64 prompts x 16 tokens: {time.perf_counter() - t:.2f} s")
    for r in list(eng.step_records)[n0:]:
        print(f"step {r.step} {r.phase:8s} T={r.num_tokens:5d} seqs={r.num_prefill_seqs + r.num_decode_seqs:3d} "
              f"wall {r.wall_seconds * 1e3:8.2f} ms  pred {r.predicted_seconds * 1e3:7.2f} ms")
    n0 = len(eng.step_records)
    t = time.perf_counter()
    llm.generate(prompts, p)
    print(f"again: {time.perf_counter() - t:.2f} s")
    recs = list(eng.step_records)[n0:]
    pre = [r.wall_seconds for r in recs if r.num_prefill_tokens]
    print(f"prefill steps {len(pre)} total {sum(pre):.2f} s median {statistics.median(pre) * 1e3:.1f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
