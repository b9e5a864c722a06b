"""analysis/busy.py: a measurement's window is busy when its threads got too little of the CPUs they asked for,
or when the rest of the machine took more than OTHERS_MAX of a CPU (the oversubscription the first sign misses)."""

import pytest

from servescope.analysis import busy


@pytest.fixture(autouse=True)
def others_max(monkeypatch):
    """The module's own figure (the suite's conftest turns the sign off for everything else)."""
    monkeypatch.setattr(busy, "OTHERS_MAX", 0.25)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, value=0.0):
        self.value = value

    def __call__(self):
        return self.value


def meter_over(wall_s, own_s, machine_s):
    wall, own, machine = Clock(100.0), Clock(5.0), Clock(1000.0)
    m = busy.CpuMeter(own=own, machine=machine, wall=wall)
    wall.value += wall_s
    own.value += own_s
    if machine_s is None:
        machine.value = None
    else:
        machine.value += machine_s
    return m.window()


def test_a_quiet_window_is_not_busy():
    w = meter_over(2.0, 3.9, 4.0)  # two threads at ~full share, the rest of the machine 0.05 CPU
    assert w.cpus_got == pytest.approx(1.95) and w.others == pytest.approx(0.05)
    assert not w.busy(2)


def test_threads_short_of_their_cpus_make_it_busy():
    w = meter_over(2.0, 1.0, 4.0)  # half a CPU per thread
    assert w.busy(2)
    assert "got 0.5 CPUs" in w.describe(2)


def test_a_neighbour_taking_cpu_makes_it_busy_even_at_full_share():
    # spinning threads count as CPU got: the threads show a full share while a neighbour took a whole CPU
    w = meter_over(2.0, 4.0, 6.0)
    assert w.cpus_got == pytest.approx(2.0) and w.others == pytest.approx(1.0)
    assert w.busy(2)
    assert "the rest of the machine 1.00" in w.describe(2)


def test_the_figure_comes_from_the_environment():
    assert busy.others_max({}) == 0.25
    assert busy.others_max({busy.OTHERS_ENV: "1.5"}) == 1.5
    assert busy.others_max({busy.OTHERS_ENV: "inf"}) == float("inf")
    for bad in ("lots", "-1", "nan"):
        with pytest.raises(ValueError, match=busy.OTHERS_ENV):
            busy.others_max({busy.OTHERS_ENV: bad})


def test_a_short_window_says_nothing():
    assert not meter_over(busy.BUSY_MIN_WINDOW_S / 2, 0.0, 10.0).busy(2)


def test_without_the_machine_clock_only_the_share_counts():
    w = meter_over(2.0, 4.0, None)
    assert w.others is None and not w.busy(2)
    assert "rest of the machine" not in w.describe(2)


def test_proc_stat_is_read_as_busy_seconds(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 5000 40 5 6 7 0 0\ncpu0 50 10 15 2500 20 2 3 3 0 0\n")
    import os
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy.machine_busy_seconds(str(stat)) == pytest.approx((100 + 20 + 30 + 5 + 6 + 7) / ticks)
    stat.write_text("intr 1 2 3\n")
    assert busy.machine_busy_seconds(str(stat)) is None
    assert busy.machine_busy_seconds(str(tmp_path / "absent")) is None


def test_the_real_clocks_see_this_process():
    m = busy.CpuMeter()
    x = 0
    for i in range(200000):
        x += i
    w = m.window()
    assert w.cpus_got > 0 and (w.others is None or w.others >= 0)
