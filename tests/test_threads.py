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
                                        (20, 25, 14),    # 1.0 busy, 0.9 ours: others 0.1, below SPARE: quiet again
                                        (20.5, 26, 15),  # a window too short to judge
                                        (30, 45, 16)))   # others hold 1.8 cores
    assert g.refit() == 1
    assert g.refit() == 2
    assert g.refit() == 2  # unchanged, and the window keeps growing from the last judged sample
    assert g.refit() == 1  # never below one thread


def test_a_quarter_of_a_core_taken_costs_a_thread():
    """A team of threads that meets at barriers stalls whenever one of its cores is taken, so others holding more
    than SPARE of a core take a thread, not only a whole core's worth (nearest-core rounding kept 2 threads at 0.4)."""
    for others, want in ((0.2, 2), (0.3, 1), (0.45, 1), (1.2, 1)):
        g = threads.Governor(2, 2, FakeLoad((0, 0, 0), (10, 10 * others + 5, 5)))
        assert g.refit() == want, others
    g = threads.Governor(8, 8, FakeLoad((0, 0, 0), (10, 10 * 1.3, 0)))
    assert g.refit() == 6  # 1.3 cores taken: two of eight


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_load_while_an_answer_streams_refits_it_and_the_next_answers_start():
    """A browser on this machine renders the streaming page while the answer decodes: `during` sees that load
    within the answer (reading /proc/stat only once STEP_WINDOW_S has passed), and the next answer starts from it
    even when the idle time since averages it away; once the load is gone, the next window gives the cores back."""
    clock = Clock()
    reads = []

    def read(samples=iter([(0, 0, 0),          # the governor starts
                           (5, 0.5, 0.5),      # answer 1 starts after 5 s: others 0
                           (5.6, 1.3, 0.9),    # 0.6 s in: busy 0.8, ours 0.4: others hold 0.67 of a core
                           (6.2, 1.9, 1.5),    # 1.2 s in: others 0 (the page idle a moment)
                           (6.8, 2.7, 1.9),    # 1.8 s in: others 0.67 again, as the answer ends
                           (65, 3.8, 2.0),     # answer 2 starts after a minute of reading: others 0.03 on average
                           (65.6, 4.6, 2.4),   # others 0.67 again
                           ])):
        reads.append(clock.t)
        return threads.LoadSample(*next(samples))

    g = threads.Governor(2, 2, read, clock=clock)
    clock.t = 5
    assert g.refit() == 2
    clock.t = 5.3
    assert g.during() == 2 and len(reads) == 2  # too early to judge: /proc/stat not read
    clock.t = 5.6
    assert g.during() == 1 and g.streaming > 0.6  # the page takes a core's worth from a spinning team
    clock.t = 6.2
    assert g.during() == 2 and abs(g.streaming) < 1e-9  # the load gone within the answer: both threads back
    clock.t = 6.8
    assert g.during() == 1
    clock.t = 65
    assert g.refit() == 1  # the minute's average says quiet, the last answer's stream says otherwise
    clock.t = 65.6
    assert g.during() == 1 and len(reads) == 7


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


def test_the_engine_refits_between_the_steps_of_an_answer(monkeypatch):
    """The decode loop asks the governor at an answer's start and before every later step, and an answer whose thread
    count changes midway is the same answer (the kernels compute each element alone: thread-invariant)."""
    from core.config import GenerationConfig
    from core.decoding.engine import Engine
    from tests.tiny import oracle_head, tiny_target

    class Flipping:  # alternates 1 and 2 threads at every step
        def __init__(self):
            self.threads, self.starts, self.steps = 2, 0, 0

        def refit(self):
            self.starts += 1
            return self.threads

        def during(self):
            self.steps += 1
            self.threads = 3 - self.threads
            return self.threads

    target = tiny_target()
    engine = Engine(target, oracle_head(target))
    config = GenerationConfig(max_new_tokens=24, speculative=False)
    plain = [t for ev in engine.generate("hello there", config) for t in ev.token_ids]
    import torch

    gov, before = Flipping(), torch.get_num_threads()
    monkeypatch.setattr(threads, "_governor", gov)
    try:
        events = list(engine.generate("hello there", config))
    finally:
        torch.set_num_threads(before)
    assert gov.starts == 1 and gov.steps == len(events) - 1 >= 20
    assert [t for ev in events for t in ev.token_ids] == plain
