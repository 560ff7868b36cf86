"""How `make serve` gives each function its own template environment inside one process."""

from __future__ import annotations

import asyncio
import os

import pytest

from local.serve import EnvironmentGate, ServeError, split_environments
from local.template import functions, local_environment
from usage_limits.web import settings

A, B = ("POST", "/a"), ("POST", "/b")


def test_split_keeps_shared_values_and_each_functions_own() -> None:
    """Shared variables are applied once; a variable one function sets is per route."""
    common, own = split_environments({A: {"X": "1", "ATTO_MAX_BODY_BYTES": "9"},
                                      B: {"X": "1"}})
    assert common == {"X": "1"}
    assert own == {A: {"ATTO_MAX_BODY_BYTES": "9"}, B: {"ATTO_MAX_BODY_BYTES": None}}


def test_split_refuses_a_variable_read_once_per_process() -> None:
    """Two functions with two LLM_RATEs cannot share a process: serve says which variable."""
    with pytest.raises(ServeError, match="LLM_RATE"):
        split_environments({A: {"LLM_RATE": "1/s"}, B: {"LLM_RATE": "2/s"}})


def test_template_functions_can_share_a_process() -> None:
    """Every function of template.yaml differs from the others only in per-request variables."""
    common, own = split_environments({(fn.method, fn.path): local_environment(fn, {})
                                      for fn in functions()})
    assert own[("POST", "/v1/embeddings")]["ATTO_MAX_BODY_BYTES"] == str(1024 * 1024)
    assert own[("POST", "/v1/structured")]["ATTO_MAX_BODY_BYTES"] is None
    assert "LLM_RATE" in common


def test_shell_and_local_stack_beat_the_template() -> None:
    """What the shell or the local stack sets wins over the template, as under sam local."""
    spec = next(fn for fn in functions() if fn.logical_id == "EmbeddingsFunction")
    env = local_environment(spec, {"ATTO_ENV": "local", "REDIS_AUTH": "none"})
    assert env["ATTO_ENV"] == "local" and env["REDIS_AUTH"] == "none"
    assert env["ATTO_MAX_BODY_BYTES"] == str(1024 * 1024)
    assert env["POWERTOOLS_SERVICE_NAME"] == "embeddings"


async def test_gate_never_overlaps_two_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of one environment overlap; one of another waits, then sees its own settings."""
    monkeypatch.delenv("ATTO_MAX_BODY_BYTES", raising=False)
    gate = EnvironmentGate({A: {"ATTO_MAX_BODY_BYTES": "1000"}, B: {"ATTO_MAX_BODY_BYTES": None}})
    log: list[tuple[str, int, int]] = []
    running: dict[str, int] = {"a": 0, "b": 0}

    async def request(name: str, route: tuple[str, str]) -> None:
        async with gate.enter(route):
            running[name] += 1
            log.append((name, running["a"], running["b"]))
            seen = settings().max_body_bytes
            await asyncio.sleep(0.01)
            assert settings().max_body_bytes == seen
            running[name] -= 1
            log.append((name + "-cap", seen, 0))

    try:
        await asyncio.gather(request("a", A), request("a", A), request("b", B), request("a", A))
    finally:
        settings.cache_clear()
        os.environ.pop("ATTO_MAX_BODY_BYTES", None)
    assert all(a == 0 or b == 0 for name, a, b in log if not name.endswith("-cap"))
    assert max(a for n, a, _ in log if n == "a") == 2  # the first two overlapped
    caps = {n: c for n, c, _ in log if n.endswith("-cap")}
    assert caps == {"a-cap": 1000, "b-cap": 256 * 1024}
