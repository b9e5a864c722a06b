"""The speculative options on the command line: serve / generate / bench flags reach EngineConfig, bad
ones are rejected with one line, and explain --speculative prints when it pays."""

import json

import pytest

from servescope.cli import build_parser, main
from servescope.cli.args import engine_config_from_args


def test_flags_reach_the_engine_config():
    a = build_parser().parse_args(["serve", "--speculative-method", "draft", "--num-speculative-tokens", "3",
                                   "--draft-model", "/m", "--draft-quantization", "int8",
                                   "--no-adaptive-speculation"])
    s = engine_config_from_args(a).speculative
    assert (s.speculative_method, s.num_speculative_tokens, s.speculative_model, s.speculative_quantization,
            s.speculative_adaptive) == ("draft", 3, "/m", "int8", False)
    a = build_parser().parse_args(["serve", "--speculative-method", "ngram", "--prompt-lookup-max", "3"])
    s = engine_config_from_args(a).speculative
    assert (s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == (4, 1, 3)
    assert not engine_config_from_args(build_parser().parse_args(["serve"])).speculative.enabled


def test_bad_k_is_one_line_exit_2(capsys):
    rc = main(["generate", "hello", "--model", "random:smollm2-135m", "--speculative-method", "ngram",
               "--num-speculative-tokens", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "num_speculative_tokens must be at least 1" in err and len(err.strip().splitlines()) == 1


def test_explain_speculative_json(capsys):
    assert main(["explain", "--config", "llama-3-8b", "--hardware", "H100-SXM", "--speculative", "ngram",
                 "-k", "4", "--acceptance", "0.8", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["speculative"]
    assert s["k"] == 4 and s["rows"][0]["speedup"] > 1.5 and s["crossover_batch"] is not None
    with pytest.raises(SystemExit):
        main(["explain", "--speculative", "eagle"])
