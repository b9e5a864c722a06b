"""llama.cpp's own tools as baselines: the commands we run, llama-bench's JSON read back, a clear
error where the tools are missing, and (where they are built) a real llama-bench run."""

from __future__ import annotations

import json

import pytest

from servescope.bench import llama_cpp_tools as lct
from servescope.errors import InvalidParameterError

# the shape of `llama-bench -o json` (llama.cpp b6xxx): one object per test
BENCH_JSON = json.dumps([
    {"build_commit": "abc", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ts": 273.4, "stddev_ts": 2.1},
    {"build_commit": "abc", "n_threads": 2, "n_prompt": 0, "n_gen": 128, "avg_ts": 103.6, "stddev_ts": 0.5},
])


def test_llama_bench_json_is_read_per_test():
    got = lct.parse_llama_bench("main: some log line\n" + BENCH_JSON)
    assert got["pp512"]["tokens_per_s"] == 273.4 and got["tg128"]["tokens_per_s"] == 103.6
    assert got["tg128"]["threads"] == 2 and set(got) == {"pp512", "tg128"}
    with pytest.raises(ValueError):
        lct.parse_llama_bench("no output")


def test_server_command_batches_continuously_over_the_slots():
    cmd = lct.llama_server_command("/x/llama-server", "m.gguf", threads=2, slots=8, ctx=4096, port=9000)
    assert cmd[0] == "/x/llama-server" and "--cont-batching" in cmd
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert (flags["-np"], flags["-c"], flags["-t"], flags["-tb"], flags["-m"]) == ("8", "4096", "2", "2", "m.gguf")
    assert lct.LlamaServer(cmd).base_url == "http://127.0.0.1:9000"
    with pytest.raises(InvalidParameterError):
        lct.llama_server_command("x", "m.gguf", threads=2, slots=8, ctx=4)


def test_missing_tool_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv(lct.ENV, str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert lct.find_tool("llama-bench") is None
    with pytest.raises(InvalidParameterError, match="BENCHMARKS.md"):
        lct.require_tool("llama-bench")
    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert lct.find_tool("llama-bench") == str(tool)


def test_real_llama_bench_runs_the_embedded_gguf():
    if lct.find_tool("llama-bench") is None:
        pytest.skip("llama-bench not built here (" + lct.BUILD_HINT + ")")
    from servescope.loader.source import resolve_model_path

    got = lct.run_llama_bench(resolve_model_path(None), threads=2, prompt=16, gen=4, reps=1)
    assert got["pp16"]["tokens_per_s"] > 0 and got["tg4"]["tokens_per_s"] > 0
