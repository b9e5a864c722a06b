"""The output processor on a fake tokenizer, without a model: stop strings across token boundaries,
stop tokens, EOS, min_tokens, length limits, logprobs, metrics and the hold-back of text that may
still become a stop string."""

import pytest

from servescope import SamplingParams
from servescope.engine.output_processor import OutputProcessor, SampledToken
from servescope.sampling.sampler import SamplingState, TokenLogprobs
from servescope.scheduler.output import ScheduledSequence, SchedulerOutput
from servescope.scheduler.request import Request, RequestStatus

EOS = 0


class FakeTokenizer:
    """Token id i decodes to VOCAB[i]; concatenation is exact (no merges across tokens)."""

    VOCAB = ["</s>", "Hel", "lo", " wo", "rld", ".", "a", "b", "S", "TO", "P", "!", "x"]
    special_token_ids = frozenset({EOS})
    eos_token_ids = frozenset({EOS})

    def encode(self, text):
        raise NotImplementedError

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i in self.special_token_ids))


def tok(piece: str) -> int:
    return FakeTokenizer.VOCAB.index(piece)


class Harness:
    """An OutputProcessor with the scheduler's part played here: appending tokens, recording finishes."""

    def __init__(self, max_model_len=64, tokenizer=FakeTokenizer()):
        self.finished = []  # (sample id, RequestStatus) as the scheduler would be told
        self.proc = OutputProcessor(tokenizer, (EOS,), max_model_len,
                                    lambda rid, status: self.finished.append((rid, status)))
        self.requests = {}

    def add(self, rid, params, prompt=(6, 7), n=1):
        samples = []
        for i in range(n):
            sid = rid if n == 1 else f"{rid}#{i}"
            req = Request(sid, list(prompt), params, arrival_time=1.0)
            self.requests[sid] = req
            samples.append((req, SamplingState(params=params, prompt_token_ids=req.prompt_token_ids,
                                               output_token_ids=req.output_token_ids)))
        self.proc.add(rid, None, list(prompt), params, samples, arrival_time=1.0)

    def step(self, tokens: dict, now=2.0, logprobs=None):
        """tokens: {sample id: token id}; returns the step's RequestOutputs."""
        for sid, t in tokens.items():
            self.requests[sid].append_output_token(t)  # Scheduler.update_from_output's part
        sampled = {sid: SampledToken(t, (logprobs or {}).get(sid)) for sid, t in tokens.items()}
        self.proc.begin_step(SchedulerOutput(), now)
        self.proc.add_tokens(sampled, now)
        return self.proc.end_step()

    def feed(self, rid, pieces, **kw):
        """Feed pieces one step each; return the RequestOutput of each step."""
        return [self.step({rid: tok(p)}, **kw)[0] for p in pieces]


def test_stop_string_across_token_boundaries_is_trimmed():
    h = Harness()
    h.add("r", SamplingParams(stop=["lo w"], max_tokens=10))
    outs = h.feed("r", ["Hel", "lo", " wo"])
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "lo w"
    assert final.text == "Hel"
    assert final.token_ids == [tok("Hel"), tok("lo"), tok(" wo")]
    assert h.finished == [("r", RequestStatus.FINISHED_STOPPED)]
    assert outs[-1].finished and "r" not in h.proc


def test_stop_string_kept_when_asked():
    h = Harness()
    h.add("r", SamplingParams(stop=["lo w"], include_stop_str_in_output=True, max_tokens=10))
    assert h.feed("r", ["Hel", "lo", " wo"])[-1].outputs[0].text == "Hello w"


def test_earliest_stop_wins():
    h = Harness()
    h.add("r", SamplingParams(stop=["wo", "o w"], max_tokens=10))
    final = h.feed("r", ["Hel", "lo", " wo"])[-1].outputs[0]  # both complete in " wo"; "o w" starts first
    assert final.stop_reason == "o w" and final.text == "Hell"


def test_stop_token_id_ends_without_its_text():
    h = Harness()
    h.add("r", SamplingParams(stop_token_ids=[tok("!")], max_tokens=10))
    final = h.feed("r", ["Hel", "!"])[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == tok("!")
    assert final.text == "Hel" and final.token_ids == [tok("Hel"), tok("!")]


def test_eos_stops_unless_ignored():
    h = Harness()
    h.add("a", SamplingParams(max_tokens=10))
    h.add("b", SamplingParams(max_tokens=10, ignore_eos=True))
    outs = {o.request_id: o for o in h.step({"a": EOS, "b": EOS})}
    assert outs["a"].outputs[0].finish_reason == "stop" and outs["a"].outputs[0].stop_reason is None
    assert outs["b"].outputs[0].finish_reason is None  # EOS is an ordinary token for b


def test_stop_string_before_min_tokens_is_ignored():
    h = Harness()
    h.add("r", SamplingParams(stop=["."], min_tokens=3, max_tokens=10))
    outs = h.feed("r", ["a", ".", "b", "."])
    assert [o.outputs[0].finish_reason for o in outs] == [None, None, None, "stop"]
    assert outs[-1].outputs[0].text == "a.b"  # the first "." came before min_tokens outputs


@pytest.mark.parametrize("max_tokens, max_model_len, steps", [(3, 64, 3), (10, 5, 3)])
def test_length_limits(max_tokens, max_model_len, steps):
    h = Harness(max_model_len=max_model_len)  # prompt of 2 tokens: 5 total = 3 outputs
    h.add("r", SamplingParams(max_tokens=max_tokens))
    outs = h.feed("r", ["a", "b", "a", "b"][:steps])
    assert [o.outputs[0].finish_reason for o in outs] == [None] * (steps - 1) + ["length"]
    assert h.finished == [("r", RequestStatus.FINISHED_LENGTH)]


def test_logprobs_accumulate():
    h = Harness()
    h.add("r", SamplingParams(logprobs=1, max_tokens=2))
    lps = [TokenLogprobs(tok("a"), -0.5, 1, [(tok("a"), -0.5)]), TokenLogprobs(tok("b"), -1.25, 2, [(tok("a"), -0.1)])]
    first = h.step({"r": tok("a")}, logprobs={"r": lps[0]})[0].outputs[0]
    final = h.step({"r": tok("b")}, logprobs={"r": lps[1]})[0].outputs[0]
    assert first.logprobs == lps[:1] and first.cumulative_logprob == -0.5
    assert final.logprobs == lps and final.cumulative_logprob == -1.75
    h.add("none", SamplingParams(max_tokens=1))
    out = h.step({"none": tok("a")})[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_streamed_text_holds_back_a_possible_stop_start():
    h = Harness()
    h.add("r", SamplingParams(stop=["STOP"], max_tokens=10))  # hold back 3 characters
    outs = h.feed("r", ["a", "b", "S", "TO"])
    assert [o.outputs[0].text for o in outs] == ["", "", "", "ab"]
    final = h.feed("r", ["P"])[0].outputs[0]
    assert final.finish_reason == "stop" and final.text == "ab"
    h.add("s", SamplingParams(stop=["STOP"], max_tokens=3))
    assert h.feed("s", ["a", "b", "S"])[-1].outputs[0].text == "abS"  # finished: nothing held back


def test_without_tokenizer_tokens_only():
    h = Harness(tokenizer=None)
    h.add("r", SamplingParams(stop=["a"], max_tokens=2))
    outs = h.feed("r", ["a", "a"])
    assert outs[-1].outputs[0].text == "" and outs[-1].outputs[0].finish_reason == "length"


def test_metrics_and_refused_requests():
    h = Harness()
    h.add("r", SamplingParams(max_tokens=2))
    req = h.requests["r"]
    seq = ScheduledSequence(req, num_new_tokens=2, num_computed_tokens=0, block_ids=[0], is_prefill=True,
                            will_sample=True)
    h.proc.begin_step(SchedulerOutput(scheduled=[seq]), 1.5)
    req.append_output_token(tok("a"))
    h.proc.add_tokens({"r": SampledToken(tok("a"), None)}, 2.0)
    h.proc.end_step()
    m = h.step({"r": tok("b")}, now=3.0)[0].metrics
    assert (m.arrival_time, m.first_scheduled_time, m.token_times) == (1.0, 1.5, [2.0, 3.0])
    assert m.finished_time is not None and m.num_prompt_tokens == 2 and m.num_cached_tokens == 0

    h.add("big", SamplingParams())
    refused = h.requests["big"]
    refused.error = "it can never fit"
    h.proc.begin_step(SchedulerOutput(finished_requests=[refused]), 4.0)
    (out,) = h.proc.end_step()
    assert out.finished and out.error == "it can never fit" and out.outputs[0].finish_reason == "error"
    assert out.metrics.finished_time == 4.0


def test_abort_and_n_samples():
    h = Harness()
    h.add("g", SamplingParams(n=2, max_tokens=2), n=2)
    out = h.step({"g#0": tok("a"), "g#1": tok("b")})
    assert len(out) == 1 and [c.text for c in out[0].outputs] == ["a", "b"]  # one output per user request
    assert h.proc.abort("g") and not h.proc.abort("g")
    assert h.finished == [("g#0", RequestStatus.FINISHED_ABORTED), ("g#1", RequestStatus.FINISHED_ABORTED)]
    assert h.proc.num_unfinished == 0
