"""The client against a local stack whose Redis is down: 503 limiter_unavailable, retried
honouring Retry-After, then raised as its typed exception."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from atto_cloud_client import AttoClient, LimiterUnavailable, RetryPolicy, ServiceUnavailable

from local.emulator import EmulatorProcess
from local.redis_servers import free_port
from tests.client.conftest import Served, stack_env, start_serve, stop_serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_without_redis(emulator: EmulatorProcess) -> Iterator[Served]:
    """``make serve`` whose REDIS_URL points at a port nothing listens on."""
    served = start_serve(stack_env(f"redis://127.0.0.1:{free_port()}/0", emulator))
    try:
        yield served
    finally:
        stop_serve(served)


def test_limiter_unavailable_is_retried_after_retry_after_then_raised(
        served_without_redis: Served, emulator: EmulatorProcess) -> None:
    """Each 503 limiter_unavailable is retried after at least its Retry-After (1 s) under
    the same key, until max_attempts; then LimiterUnavailable is raised; no provider ran."""
    emulator.reset()
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    policy = RetryPolicy(max_attempts=3, total_s=30, jitter=0.2)
    with AttoClient(served_without_redis.url, user="alice", retry=policy, sleep=sleep,
                    clock=lambda: now[0]) as atto, pytest.raises(LimiterUnavailable) as raised:
        atto.structured("x", {"type": "string"})
    error = raised.value
    assert isinstance(error, ServiceUnavailable) and error.status == 503
    assert error.code == "limiter_unavailable" and error.retry_after_s == 1
    assert error.attempts == 3 and len(slept) == 2
    assert all(1.0 <= s <= 1.2 for s in slept)
    assert emulator.family_stats("llm")["arrivals"] == 0


def test_limiter_unavailable_stops_when_the_total_time_is_spent(
        served_without_redis: Served) -> None:
    """With 2.5 s of total time and Retry-After 1 s, the client waits twice at most and
    raises once the next wait would pass the total."""
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    policy = RetryPolicy(max_attempts=10, total_s=2.5, jitter=0.0)
    with AttoClient(served_without_redis.url, user="alice", retry=policy, sleep=sleep,
                    clock=lambda: now[0]) as atto, pytest.raises(LimiterUnavailable) as raised:
        atto.usage()
    assert slept == [1.0, 1.0] and raised.value.attempts == 3
