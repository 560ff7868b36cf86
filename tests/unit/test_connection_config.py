"""Connection settings: read once from the environment, validated, explicit arguments win."""

from __future__ import annotations

import pytest

from usage_limits.config import ConnectionSettings, RedisAddress
from usage_limits.exceptions import InvalidArgument

URL = "redis://127.0.0.1:6379/0"
IAM = {"REDIS_URL": "rediss://cache.example:6379", "REDIS_AUTH": "iam", "REDIS_USER": "app",
       "ELASTICACHE_CACHE_NAME": "atto", "AWS_REGION": "eu-west-1"}


def test_defaults_are_explicit_and_small() -> None:
    """A URL alone gives short timeouts, one retry, no cluster and no extra auth."""
    s = ConnectionSettings.from_env({"REDIS_URL": URL})
    assert (s.socket_timeout_s, s.connect_timeout_s, s.retries) == (0.5, 1.0, 1)
    assert (s.cluster, s.auth, s.serverless) == (False, "none", True)
    assert s.max_connections == 32 and s.health_check_interval_s == 30.0


def test_every_variable_is_read() -> None:
    """Each REDIS_* / ElastiCache / AWS variable lands in its field."""
    s = ConnectionSettings.from_env({
        **IAM, "REDIS_CLUSTER": "TRUE", "REDIS_SOCKET_TIMEOUT_S": "0.25",
        "REDIS_CONNECT_TIMEOUT_S": "2", "REDIS_RETRIES": "3", "REDIS_MAX_CONNECTIONS": "8",
        "REDIS_HEALTH_CHECK_INTERVAL_S": "0", "REDIS_TLS_CA_FILE": "/ca.pem",
        "ELASTICACHE_SERVERLESS": "no"})
    assert s.cluster and s.socket_timeout_s == 0.25 and s.connect_timeout_s == 2.0
    assert (s.retries, s.max_connections, s.health_check_interval_s) == (3, 8, 0.0)
    assert (s.auth, s.user, s.cache_name, s.region) == ("iam", "app", "atto", "eu-west-1")
    assert s.tls_ca_file == "/ca.pem" and s.serverless is False


def test_explicit_arguments_beat_the_environment() -> None:
    """An override replaces the variable; None overrides are ignored."""
    s = ConnectionSettings.from_env({"REDIS_URL": URL, "REDIS_RETRIES": "3"},
                                    retries=0, url="redis://other:7000", cluster=None)
    assert s.retries == 0 and s.address.host == "other" and s.address.port == 7000


def test_os_environ_is_the_default_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a mapping the process environment is read."""
    monkeypatch.setenv("REDIS_URL", "redis://envhost:6390/1")
    monkeypatch.setenv("REDIS_SOCKET_TIMEOUT_S", "0.75")
    s = ConnectionSettings.from_env()
    assert s.address.host == "envhost" and s.address.db == 1 and s.socket_timeout_s == 0.75


def test_empty_variables_count_as_unset() -> None:
    """SAM passes empty strings for parameters left at their default."""
    s = ConnectionSettings.from_env({"REDIS_URL": URL, "REDIS_RETRIES": "", "REDIS_AUTH": " "})
    assert s.retries == 1 and s.auth == "none"


def test_region_falls_back_to_aws_default_region() -> None:
    """AWS_DEFAULT_REGION is used when AWS_REGION is absent."""
    env = {k: v for k, v in IAM.items() if k != "AWS_REGION"}
    settings = ConnectionSettings.from_env({**env, "AWS_DEFAULT_REGION": "us-east-2"})
    assert settings.region == "us-east-2"


def test_url_parts_are_parsed_and_decoded() -> None:
    """User, percent-encoded password, port, db and TLS come from the URL."""
    a = RedisAddress.parse("rediss://bob:p%40ss%3Aw@h.example:6380/3")
    assert (a.host, a.port, a.db, a.tls, a.username, a.password) == (
        "h.example", 6380, 3, True, "bob", "p@ss:w")
    b = RedisAddress.parse("redis://h")
    assert (b.port, b.db, b.tls, b.username, b.password) == (6379, 0, False, None, None)


def test_password_never_shows_in_repr() -> None:
    """Neither the settings nor the address repr reveals the URL's password."""
    s = ConnectionSettings.from_env({"REDIS_URL": "redis://u:hunter2@h:1/0"})
    assert "hunter2" not in repr(s) and "hunter2" not in repr(s.address)


@pytest.mark.parametrize(("env", "fragment"), [
    ({}, "REDIS_URL is not set"),
    ({"REDIS_URL": "http://h:1"}, "redis:// or rediss://"),
    ({"REDIS_URL": "unix:///tmp/r.sock"}, "redis:// or rediss://"),
    ({"REDIS_URL": "redis://:6379"}, "no host"),
    ({"REDIS_URL": "redis://h:99999"}, "invalid port"),
    ({"REDIS_URL": "redis://h:1/x"}, "database number"),
    ({"REDIS_URL": "redis://h:1/0?ssl_cert_reqs=none"}, "?options"),
    ({"REDIS_URL": URL, "REDIS_SOCKET_TIMEOUT_S": "fast"}, "REDIS_SOCKET_TIMEOUT_S"),
    ({"REDIS_URL": URL, "REDIS_SOCKET_TIMEOUT_S": "0"}, "greater than 0"),
    ({"REDIS_URL": URL, "REDIS_CONNECT_TIMEOUT_S": "nan"}, "REDIS_CONNECT_TIMEOUT_S"),
    ({"REDIS_URL": URL, "REDIS_CONNECT_TIMEOUT_S": "inf"}, "REDIS_CONNECT_TIMEOUT_S"),
    ({"REDIS_URL": URL, "REDIS_HEALTH_CHECK_INTERVAL_S": "-1"}, "at least 0"),
    ({"REDIS_URL": URL, "REDIS_RETRIES": "1.5"}, "REDIS_RETRIES"),
    ({"REDIS_URL": URL, "REDIS_RETRIES": "-1"}, "from 0 to 10"),
    ({"REDIS_URL": URL, "REDIS_MAX_CONNECTIONS": "0"}, "REDIS_MAX_CONNECTIONS"),
    ({"REDIS_URL": URL, "REDIS_CLUSTER": "maybe"}, "REDIS_CLUSTER must be true or false"),
    ({"REDIS_URL": URL, "REDIS_AUTH": "password"}, "none, iam, secret"),
    ({"REDIS_URL": "redis://h:1/2", "REDIS_CLUSTER": "1"}, "only has database 0"),
    ({"REDIS_URL": URL, "REDIS_AUTH": "secret"}, "needs REDIS_SECRET_ARN"),
    ({"REDIS_URL": "rediss://u:p@h", "REDIS_AUTH": "secret", "REDIS_SECRET_ARN": "s"},
     "must not hold a user or password"),
])
def test_bad_values_raise_invalid_argument(env: dict[str, str], fragment: str) -> None:
    """Each malformed or inconsistent value raises InvalidArgument naming the problem."""
    with pytest.raises(InvalidArgument, match=fragment.replace("?", r"\?")):
        ConnectionSettings.from_env(env)


@pytest.mark.parametrize("missing", ["REDIS_USER", "ELASTICACHE_CACHE_NAME", "AWS_REGION"])
def test_iam_names_each_missing_variable(missing: str) -> None:
    """REDIS_AUTH=iam without its user, cache name or region says which one is missing."""
    env = {k: v for k, v in IAM.items() if k != missing}
    with pytest.raises(InvalidArgument, match=f"needs {missing}"):
        ConnectionSettings.from_env(env)


def test_iam_requires_tls() -> None:
    """ElastiCache takes IAM tokens only over TLS, so redis:// with iam is refused."""
    with pytest.raises(InvalidArgument, match="needs TLS"):
        ConnectionSettings.from_env({**IAM, "REDIS_URL": "redis://cache.example:6379"})


def test_password_in_url_does_not_leak_into_errors() -> None:
    """Error messages about the URL never repeat its password."""
    with pytest.raises(InvalidArgument) as info:
        ConnectionSettings.from_env({"REDIS_URL": "redis://u:hunter2@h:1/x"})
    assert "hunter2" not in str(info.value)


def test_direct_construction_is_validated_too() -> None:
    """Building the dataclass directly runs the same checks as reading the environment."""
    with pytest.raises(InvalidArgument, match="REDIS_RETRIES"):
        ConnectionSettings(url=URL, retries=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="REDIS_SOCKET_TIMEOUT_S"):
        ConnectionSettings(url=URL, socket_timeout_s="1")  # type: ignore[arg-type]


def test_unknown_override_is_a_type_error() -> None:
    """A misspelt keyword fails loudly instead of being ignored."""
    with pytest.raises(TypeError, match="socket_timeout"):
        ConnectionSettings.from_env({"REDIS_URL": URL}, socket_timeout=1.0)


def test_settings_are_frozen() -> None:
    """Settings cannot be changed after they were read."""
    s = ConnectionSettings.from_env({"REDIS_URL": URL})
    with pytest.raises(AttributeError):
        s.retries = 5  # type: ignore[misc]
