"""The OpenMP policy chosen at start from how busy the machine is (core.threads); start() itself:
tests/test_imports.py."""

import pytest

from core import threads


def test_quiet_machine_gets_a_short_spin_and_every_core():
    policy, variables = threads.choose({}, idle=1.9, cores=2)
    assert variables == {"GOMP_SPINCOUNT": threads.SHORT_SPIN}
    assert (policy.wait, policy.default_threads) == ("short spin", 2)


@pytest.mark.parametrize("idle, expected", [(1.2, 1), (0.9, 1), (0.05, 1), (2.6, 3)])
def test_busy_machine_sleeps_at_once_and_uses_the_idle_cores(idle, expected):
    policy, variables = threads.choose({}, idle=idle, cores=4 if idle > 2 else 2)
    assert variables == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert (policy.wait, policy.default_threads) == ("passive", expected)


def test_a_users_openmp_setting_wins():
    policy, variables = threads.choose({"OMP_WAIT_POLICY": "ACTIVE"}, idle=2.0, cores=2)
    assert variables == {}
    assert policy.wait == "user: OMP_WAIT_POLICY=ACTIVE"
    assert "user: OMP_WAIT_POLICY=ACTIVE wait" in policy.describe()


def test_unknown_load_falls_back_to_the_safe_passive_policy():
    policy, variables = threads.choose({}, idle=None, cores=2)
    assert variables == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert policy.default_threads == 2 and "not measured" in policy.describe()


def test_idle_cores_are_measured_within_the_cores_this_process_may_use():
    idle = threads.measure_idle_cores(0.05)
    assert idle is not None and 0.0 <= idle <= threads.available_cores()


class FakeLoad:
    """LoadSamples from a script: (wall s, busy CPU s of everyone, own CPU s)."""

    def __init__(self, *samples):
        self.samples = [threads.LoadSample(*s) for s in samples]

    def __call__(self):
        return self.samples.pop(0)


def test_governor_drops_to_the_cores_others_left_idle_and_comes_back():
    g = threads.Governor(2, 2, FakeLoad((0, 0, 0),
                                        (10, 15, 5),     # 1.5 cores busy, 0.5 ours: others hold 1 core
                                        (20, 25, 10),    # 1.0 busy, all ours: quiet again
                                        (20.5, 26, 11),  # a window too short to judge
                                        (30, 45, 12)))   # others hold 1.8 cores
    assert g.refit() == 1
    assert g.refit() == 2
    assert g.refit() == 2  # unchanged, and the window keeps growing from the last judged sample
    assert g.refit() == 1  # never below one thread


def test_governor_without_load_readings_keeps_its_thread_count():
    g = threads.Governor(2, 2, lambda: None)
    assert g.refit() == 2


def test_apply_sets_the_governed_count_in_the_thread_that_decodes():
    import threading

    import torch

    before = torch.get_num_threads()
    seen = []
    try:
        threads.govern()
        threads._governor.threads = 1
        worker = threading.Thread(target=lambda: (threads.apply(), seen.append(torch.get_num_threads())))
        worker.start()
        worker.join()
        assert seen == [1]
        assert threads.current() == 1  # what decoding runs with, whatever this thread's count
    finally:
        threads.govern(False)
        torch.set_num_threads(before)
    threads.apply()  # governor off: leaves the count alone
    assert torch.get_num_threads() == before == threads.current()


def test_load_sample_reads_this_machine():
    a = threads.load_sample()
    assert a is not None and a.busy_s >= 0 and a.own_s >= 0
