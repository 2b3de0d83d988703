"""core.clock: CUDA-synchronised wall time and event timers; the CUDA paths with fakes, on CPU."""

import time

import pytest
import torch

from core import clock


def test_now_on_cpu_is_perf_counter_and_never_synchronises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronised a CPU clock"))
    a = clock.now("cpu")
    b = clock.now(torch.device("cpu"))
    assert isinstance(a, float) and a <= b <= time.perf_counter()


def test_now_on_cuda_synchronises_that_device_first(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock.now("cuda:1")
    assert calls == ["cuda:1"]


def test_timer_on_cpu_measures_the_block():
    with clock.Timer("cpu") as t:
        time.sleep(0.02)
    assert 0.02 <= t.seconds < 1.0


class FakeEvent:
    """Stands in for torch.cuda.Event: a start recorded at 0 ms, an end at 7.5 ms."""
    recorded = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.synced = False

    def record(self, stream=None):
        self.at_ms = 7.5 * len(FakeEvent.recorded)
        FakeEvent.recorded.append(stream)

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "read before the end event completed"
        return end.at_ms - self.at_ms


def test_timer_on_cuda_uses_events_and_reports_seconds(monkeypatch):
    FakeEvent.recorded = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a timer must not stall the device"))
    with clock.Timer("cuda:0") as t:
        pass
    assert FakeEvent.recorded == ["stream of cuda:0"] * 2
    assert t.seconds == pytest.approx(0.0075)  # events count milliseconds


def test_median_time_warms_up_then_takes_the_median(monkeypatch):
    durations = iter([100.0, 3.0, 1.0, 2.0])  # the warm-up call, then three timed ones

    class FakeTimer:
        def __init__(self, device):
            self.seconds = next(durations)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(clock, "Timer", FakeTimer)
    calls, after = [], []
    seconds = clock.median_time(lambda: calls.append(1), "cpu", reps=3, warmup=1, after=lambda: after.append(1))
    assert seconds == 2.0
    assert len(calls) == len(after) == 4
