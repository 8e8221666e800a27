"""The sanity checks fire on impossible timings, injected through fake clocks, and stay quiet
on plausible ones; a check that fires once is measured again before it is believed."""
from conftest import clock_of_durations
from minitransformer.measure.sanity import (
    NOISE_FLOOR,
    cost_falls,
    recheck,
    slower,
    speedup_bound,
    spikes,
)
from minitransformer.measure.timing import Timing, time_together


def quiet(seconds):
    return Timing((seconds,) * 3)


def step_costs(rounds):
    """Batch sizes 1, 2, 4 timed together, one list of per-round durations per measurement:
    -> a measure() for recheck that consumes one measurement per call."""
    measurements = iter(rounds)

    def measure(previous):
        durations = next(measurements)      # [(t1, t2, t4) per round, ...]
        clock = clock_of_durations(*[t for rnd in durations for t in rnd])
        return time_together([lambda: None] * 3, warmup=0, repeat=len(durations), clock=clock)
    return measure


def test_step_costs_out_of_order_fire():
    # seen on a busy machine: a batch of 7 in 28 ms, a batch of 1 in 184 ms
    found = cost_falls([1, 7], [quiet(0.184), quiet(0.028)], "batch")
    assert list(found) == [1] and "batch 7 costs 0.15x batch 1" in found[1]


def test_a_fall_within_the_floor_is_not_a_warning_and_noise_is_no_excuse():
    assert cost_falls([1, 2], [quiet(0.100), quiet(0.100 * (1 - NOISE_FLOOR / 2))]) == {}
    assert cost_falls([1, 2], [quiet(0.100), quiet(0.070)]) != {}
    # the same machine's exp 12 again: B = 24 disturbed in every sample, B = 32 quiet once; the wide
    # spread of the larger batch does not hide the impossibility
    disturbed, lucky = Timing((0.341, 0.704, 0.690)), Timing((0.077, 0.662, 0.650))
    assert list(cost_falls([24, 32], [disturbed, lucky], "batch")) == [1]


def test_a_disturbed_measurement_is_measured_again_and_the_warning_goes():
    # first measurement: batch 4 disturbed the other way (batch 2 hit by load, 4 quiet);
    # the re-measurement is ordered as it should be
    measure = step_costs([[(10, 30, 20)] * 3, [(10, 12, 20)] * 3])
    timings, found = recheck(measure, lambda t: cost_falls([1, 2, 4], t, "batch"))
    assert found == {}
    assert [t.best for t in timings] == [10, 12, 20]


def test_a_persistent_impossibility_is_reported():
    measure = step_costs([[(10, 30, 20)] * 3, [(10, 31, 20)] * 3])
    timings, found = recheck(measure, lambda t: cost_falls([1, 2, 4], t, "batch"))
    assert list(found) == [2] and "batch 4 costs" in found[2]


def test_cached_slower_than_recompute_fires():
    assert slower(quiet(2.0), quiet(1.0)) is not None
    assert slower(quiet(1.0), quiet(2.0)) is None
    assert slower(quiet(1.05), quiet(1.0)) is None           # within the tolerance


def test_prefill_spike_fires_on_one_outlier_only():
    # seen on a busy machine: one 1,466 ms outlier among passes of a few ms per token
    sizes = [8, 16, 32, 64]
    runs = [quiet(0.040), quiet(1.466), quiet(0.120), quiet(0.230)]
    found = spikes(sizes, sizes, runs)
    assert list(found) == [1]
    smooth = [quiet(0.040), quiet(0.070), quiet(0.120), quiet(0.230)]
    assert spikes(sizes, sizes, smooth) == {}


def test_speedup_bound():
    # seen on a busy machine: 4.18x with 1.37 tokens kept per target pass
    assert "ceiling" in speedup_bound(4.18, 1.37, 4, 0.1)
    assert speedup_bound(1.30, 1.37, 4, 0.0) is None         # 1.37 / 1 allows 1.37x
    assert speedup_bound(1.60, 1.37, 4, 0.0) is not None
