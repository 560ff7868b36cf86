"""The cache user's ACL from template.yaml, applied to a real redis-server.

ElastiCache access strings use Redis ACL rules, so the template's default
(``CacheAccessString``) is installed on a private server as a password user, and the
library's own Lua scripts and the commands a cluster client sends are run as that user.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError, ResponseError

from local.redis_servers import RedisServer
from local.template import load_template

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "layers/usage_limits/usage_limits/lua"
USER, PASSWORD = "atto-app", "test-only-password"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A private redis-server whose ACL has the template's cache user."""
    access = load_template()["Parameters"]["CacheAccessString"]["Default"].split()
    with RedisServer() as srv:
        admin = redis.Redis(port=srv.port)
        admin.execute_command("ACL", "SETUSER", USER, "reset", f">{PASSWORD}", *access)
        admin.close()
        yield srv


@pytest.fixture
def app_client(server: RedisServer) -> Iterator[redis.Redis]:
    """A client logged in as the functions' cache user."""
    client = redis.Redis(port=server.port, username=USER, password=PASSWORD)
    try:
        yield client
    finally:
        client.close()


def test_library_scripts_run_on_library_keys(app_client: redis.Redis) -> None:
    """Every usage_limits Lua script loads, and scripts may touch keys under ul:."""
    scripts = sorted(LUA.glob("*.lua"))
    assert scripts
    for script in scripts:
        assert len(app_client.script_load(script.read_text())) == 40
    touched = app_client.eval("redis.call('SET', KEYS[1], '1'); return redis.call('GET', KEYS[1])",
                              1, "ul:{u:acl-test}:meta")
    assert touched == b"1"


def test_keys_outside_the_prefix_are_refused(app_client: redis.Redis) -> None:
    """The cache user cannot read or write keys outside ul:."""
    with pytest.raises(NoPermissionError):
        app_client.set("other:key", "1")
    with pytest.raises((NoPermissionError, ResponseError)):
        app_client.eval("return redis.call('GET', KEYS[1])", 1, "other:key")


def test_dangerous_commands_are_refused(app_client: redis.Redis) -> None:
    """FLUSHALL, KEYS and CONFIG are refused to the cache user."""
    for command in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "maxmemory")):
        with pytest.raises(NoPermissionError):
            app_client.execute_command(*command)


def test_cluster_client_commands_are_allowed(server: RedisServer) -> None:
    """The commands a cluster client sends on connect are allowed to the cache user."""
    admin = redis.Redis(port=server.port)
    try:
        for command in (("CLUSTER", "SLOTS"), ("CLUSTER", "SHARDS"), ("READONLY",),
                        ("COMMAND", "COUNT"), ("PING",), ("HELLO", "3")):
            assert admin.execute_command("ACL", "DRYRUN", USER, *command) == b"OK", command
    finally:
        admin.close()
