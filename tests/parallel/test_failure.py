"""A worker that stops answering (SIGSTOP: alive, silent) fails the engine loudly once the collective
timeout passes, never a silent hang; every later step fails at once with the same reason, and shutdown
ends the workers."""

import os
import signal
import time

import pytest

from servescope import LLM, SamplingParams
from servescope.errors import WorkerFailedError
from tiny_models import make_tiny_hf_model

TIMEOUT_S = 5.0  # far above a tiny model's step even on a loaded machine (milliseconds); the hang still ends


def test_hung_worker_fails_the_step_within_the_timeout(tmp_path):
    path = str(make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False))
    llm = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=256, num_threads=1,
              pipeline_parallel_size=2, distributed_timeout_s=TIMEOUT_S)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (proc,) = llm.engine.executor.workers.procs
    try:
        assert len(llm.generate([1, 2, 3], params)[0].outputs[0].token_ids) == 4
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"did not answer within 5 s; the engine must be restarted"):
            llm.generate([4, 5, 6], params)
        waited = time.monotonic() - t0
        assert TIMEOUT_S * 0.9 <= waited < 10 * TIMEOUT_S  # the timeout, not a hang
        with pytest.raises(WorkerFailedError, match="did not answer"):  # the engine stays failed
            llm.generate([7], params)
        assert not llm.engine.has_unfinished()  # the failed requests were aborted, their blocks freed
        assert llm.engine.kv_manager.num_used_blocks == 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        llm.engine.shutdown()
    assert proc.exitcode is not None
