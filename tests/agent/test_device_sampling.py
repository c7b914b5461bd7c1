"""The device sampler: which steps carry device timing, fixed or adaptive to a budget."""

from __future__ import annotations

from agent.device_sampling import DeviceSampler, DeviceSamplingPolicy


def _pattern(sampler: DeviceSampler, steps: int) -> list[bool]:
    return [sampler.next_is_sampled() for _ in range(steps)]


def test_a_fixed_interval_samples_one_step_in_n_from_the_first() -> None:
    sampler = DeviceSampler(DeviceSamplingPolicy(every=4))
    assert _pattern(sampler, 9) == [True, False, False, False, True, False, False, False, True]
    sampler.observe(device_calls_ns=10**9, step_ns=1)  # a fixed interval ignores the cost
    assert sampler.interval == 4
    assert sampler.statistics() == {"device_steps_sampled": 3, "device_steps_host_only": 6,
                                    "device_sampling_interval": 4}


def test_adaptive_keeps_the_device_calls_under_the_budget() -> None:
    policy = DeviceSamplingPolicy(budget=0.002, max_every=64)
    sampler = DeviceSampler(policy)
    assert sampler.next_is_sampled()  # the first step always carries device timing
    # 100 us of device calls on a 10 ms step: 1% of it; 0.2% allows one step in 5.
    sampler.observe(device_calls_ns=100_000, step_ns=10_000_000)
    assert sampler.interval == 5
    assert _pattern(sampler, 10) == [False, False, False, False, True, False, False, False, False, True]
    # The same calls on a 100 ms step fit the budget every step.
    sampler.observe(device_calls_ns=100_000, step_ns=100_000_000)
    assert sampler.interval == 1
    assert _pattern(sampler, 3) == [True, True, True]


def test_adaptive_never_waits_longer_than_max_every() -> None:
    sampler = DeviceSampler(DeviceSamplingPolicy(budget=0.002, max_every=16))
    sampler.next_is_sampled()
    sampler.observe(device_calls_ns=100_000, step_ns=100_000)  # the calls take the whole step
    assert sampler.interval == 16
    assert _pattern(sampler, 16).count(True) == 1


def test_a_step_of_no_length_changes_nothing() -> None:
    sampler = DeviceSampler()
    sampler.next_is_sampled()
    sampler.observe(device_calls_ns=5_000, step_ns=0)
    assert sampler.interval == 1
