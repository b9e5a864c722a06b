"""/metrics carries vLLM's speculative-decoding counters, fed from the engine's totals."""

from prometheus_client.parser import text_string_to_metric_families

from servescope.server.metrics import ServerMetrics


def _totals(m: ServerMetrics) -> dict:
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    return {n: sum(s.value for s in fams[f"servescope:{n}"].samples if s.name.endswith("_total"))
            for n in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}


def test_spec_decode_counters_follow_engine_totals():
    m = ServerMetrics("m")
    assert set(_totals(m).values()) == {0}
    m.update_state({"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 12,
                    "spec_decode_num_accepted_tokens": 7})
    m.update_state({"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 20,
                    "spec_decode_num_accepted_tokens": 15})
    assert _totals(m) == {"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 20,
                          "spec_decode_num_accepted_tokens": 15}
