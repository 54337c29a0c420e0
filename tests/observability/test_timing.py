"""course_lib.observability.timing: warm-up, medians, alternation, threads (scripts/bench.py is tested in test_bench.py)."""

from collections import Counter

import pytest
import torch

from course_lib.observability.timing import (machine_info, machine_line, setup_threads, time_alternating, time_fn,
                                             Timing, williams_orders)


class FakeClock:
    """A clock that only moves when a timed function advances it: timings become exact numbers."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted(clock: FakeClock, durations):
    """A function whose i-th call takes durations[i] seconds of fake time."""
    it = iter(durations)

    def fn():
        clock.now += next(it)
    return fn


def test_time_fn_drops_warmup_and_takes_the_median():
    clock = FakeClock()
    # Two slow warm-up calls (100 s) must not show up; the median of 1, 5, 2, 9, 3 is 3.
    fn = scripted(clock, [100.0, 100.0, 1.0, 5.0, 2.0, 9.0, 3.0])
    t = time_fn(fn, warmup=2, repeats=5, clock=clock)
    assert t.samples == (1.0, 5.0, 2.0, 9.0, 3.0)
    assert t.median == 3.0
    assert t.quartiles == (2.0, 5.0)
    assert t.relative_spread == pytest.approx(1.0)


def test_time_fn_calls_sync_around_each_timed_call():
    events = []
    time_fn(lambda: events.append("fn"), warmup=1, repeats=2, sync=lambda: events.append("sync"))
    assert events == ["fn", "sync", "fn", "sync", "sync", "fn", "sync"]


def test_time_alternating_takes_turns_after_warmup():
    clock = FakeClock()
    order = []

    def make(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return fn

    result = time_alternating({"A": make("A", 2.0), "B": make("B", 0.5)}, warmup=1, rounds=3, clock=clock)
    assert order == ["A", "B"] * 4
    assert list(result) == ["A", "B"]
    assert result["A"].samples == (2.0, 2.0, 2.0)
    assert result["A"].median / result["B"].median == 4.0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_williams_orders_put_every_pair_back_to_back_equally_often(n):
    orders = williams_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    pairs = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    expected = 1 if n % 2 == 0 else 2
    assert pairs == {(a, b): expected for a in range(n) for b in range(n) if a != b}


def test_balanced_turns_let_every_variant_follow_every_other():
    clock = FakeClock()
    order = []

    def make(name):
        def fn():
            order.append(name)
            clock.now += 1.0
        return fn

    result = time_alternating({n: make(n) for n in "ABCD"}, warmup=1, rounds=4, clock=clock, balanced=True)
    timed = order[4:]  # after the warm-up round A B C D
    assert timed == list("ABDC") + list("BCAD") + list("CDBA") + list("DACB")
    followers = {name: {b for a, b in zip(timed, timed[1:]) if a == name} for name in "ABCD"}
    assert followers == {name: set("ABCD") - {name} for name in "ABCD"}
    assert [len(result[n].samples) for n in "ABCD"] == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="n"):
        williams_orders(0)


def test_alternation_shares_machine_noise():
    """A slowdown that hits one round hits both variants, so the per-round ratio stays put."""
    clock = FakeClock()
    load = iter([1, 1, 10, 10, 1, 1])  # round 2 of 3 runs ten times slower, for both variants

    def make(seconds):
        def fn():
            clock.now += seconds * next(load)
        return fn

    result = time_alternating({"A": make(3.0), "B": make(1.0)}, warmup=0, rounds=3, clock=clock)
    assert [a / b for a, b in zip(result["A"].samples, result["B"].samples)] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(warmup=-1), "warmup"), (dict(repeats=0), "repeats"), (dict(repeats=2.5), "repeats"),
    (dict(warmup=True), "warmup"),
])
def test_time_fn_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_fn(lambda: None, **kwargs)


def test_bad_callables_and_mappings():
    with pytest.raises(TypeError, match="fn must be callable"):
        time_fn(42)
    with pytest.raises(ValueError, match="non-empty mapping"):
        time_alternating({})
    with pytest.raises(TypeError, match=r"fns\['B'\] must be callable"):
        time_alternating({"A": lambda: None, "B": None})
    with pytest.raises(ValueError, match="rounds"):
        time_alternating({"A": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="at least one sample"):
        Timing(())


def test_setup_threads_sets_and_validates():
    before = torch.get_num_threads()
    try:
        assert setup_threads(1) == 1 == torch.get_num_threads()
        assert setup_threads() >= 1
        with pytest.raises(ValueError, match="num_threads"):
            setup_threads(0)
    finally:
        torch.set_num_threads(before)


def test_machine_line_names_cores_threads_and_torch():
    info = machine_info()
    assert info["cores"] >= 1 and info["torch_threads"] == torch.get_num_threads()
    line = machine_line(info)
    assert f"{info['cores']} cores" in line and torch.__version__ in line and "torch thread" in line  # "1 torch thread" after a test that set one
