"""The link probe: two gloo processes time every size asked, and the engine's fit takes what they measured
(the model's own terms are tested in tests/analysis/test_collectives.py, without processes)."""

import pytest

from servescope.analysis.collectives import all_reduce_seconds
from servescope.parallel.link_probe import fit_local_link, measure_all_reduce, socket_buffer_bytes


@pytest.mark.timeout(300)
def test_probe_times_every_size_and_the_fit_predicts_them():
    sizes = (8 * 1024, 64 * 1024, 256 * 1024, 5 << 20)  # the last past gloo's regime change (2N MiB: more steps)
    measured = measure_all_reduce(sizes, runs=3)
    assert sorted(measured) == list(sizes) and all(t > 0 for t in measured.values())
    link = fit_local_link(measured)
    assert link.max_segment_bytes and link.bandwidth > 0 and link.call_s >= 0 and link.step_s >= 0
    for b, t in measured.items():  # four sizes, four terms at most: a loose check, times are noisy
        assert all_reduce_seconds(b, 2, link) == pytest.approx(t, rel=1.0)


def test_socket_buffer_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "tcp_rmem"
    f.write_text("4096\t131072\t33554432\n")
    assert socket_buffer_bytes(str(f)) == 131072
    assert socket_buffer_bytes(str(tmp_path / "absent")) == 0  # not Linux: one rate for every byte
    f.write_text("garbage")
    assert socket_buffer_bytes(str(f)) == 0
