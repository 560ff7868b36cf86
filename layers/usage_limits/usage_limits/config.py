"""Settings read once from the environment into frozen objects.

Every environment variable name is a constant here, and docs/configuration.md documents each one. An
explicit argument always beats the environment variable. An empty variable counts as unset
(SAM passes empty strings for parameters left at their default).

Validation happens when a settings object is built, so a misconfigured function fails on
its first use with an ``InvalidArgument`` that names the variable, not later with a socket
error. Messages never repeat a value that could hold a password.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from .exceptions import InvalidArgument

# --- Redis connection -----------------------------------------------------------------------
REDIS_URL_ENV = "REDIS_URL"
REDIS_CLUSTER_ENV = "REDIS_CLUSTER"
REDIS_SOCKET_TIMEOUT_ENV = "REDIS_SOCKET_TIMEOUT_S"
REDIS_CONNECT_TIMEOUT_ENV = "REDIS_CONNECT_TIMEOUT_S"
REDIS_RETRIES_ENV = "REDIS_RETRIES"
REDIS_MAX_CONNECTIONS_ENV = "REDIS_MAX_CONNECTIONS"
REDIS_HEALTH_CHECK_INTERVAL_ENV = "REDIS_HEALTH_CHECK_INTERVAL_S"
REDIS_TLS_CA_FILE_ENV = "REDIS_TLS_CA_FILE"
REDIS_AUTH_ENV = "REDIS_AUTH"
REDIS_USER_ENV = "REDIS_USER"
ELASTICACHE_CACHE_NAME_ENV = "ELASTICACHE_CACHE_NAME"
ELASTICACHE_SERVERLESS_ENV = "ELASTICACHE_SERVERLESS"
REDIS_SECRET_ARN_ENV = "REDIS_SECRET_ARN"
AWS_REGION_ENV = "AWS_REGION"
AWS_DEFAULT_REGION_ENV = "AWS_DEFAULT_REGION"

AuthMode = Literal["none", "iam", "secret"]
AUTH_MODES: tuple[AuthMode, ...] = ("none", "iam", "secret")
SCHEMES = ("redis", "rediss")
MAX_RETRIES = 10

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class RedisAddress:
    """Where to connect, parsed from ``REDIS_URL``.

    Attributes:
        host: host name or IP address.
        port: TCP port (6379 when the URL names none).
        db: database number from the URL path (0 when absent; always 0 in cluster mode).
        tls: True for ``rediss://``.
        username: user from the URL, if any.
        password: password from the URL, if any (never shown by ``repr``).
    """

    host: str
    port: int
    db: int
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> RedisAddress:
        """Parse ``redis://[user[:password]@]host[:port][/db]`` (or ``rediss://``).

        Args:
            url: the connection URL.

        Returns:
            The parsed address; user and password are percent-decoded.

        Raises:
            InvalidArgument: unknown scheme, missing host, bad port or db, or query options.
        """
        if not isinstance(url, str) or not url.strip():
            raise InvalidArgument(f"{REDIS_URL_ENV} is empty")
        parts = urlsplit(url.strip())
        if parts.scheme not in SCHEMES:
            raise InvalidArgument(f"{REDIS_URL_ENV} must start with redis:// or rediss:// "
                                  f"(got scheme {parts.scheme!r})")
        if not parts.hostname:
            raise InvalidArgument(f"{REDIS_URL_ENV} has no host")
        try:
            port = parts.port or 6379
        except ValueError:
            raise InvalidArgument(f"{REDIS_URL_ENV} has an invalid port") from None
        if parts.query or parts.fragment:
            raise InvalidArgument(f"{REDIS_URL_ENV} must not carry ?options or #fragments; "
                                  "use the REDIS_* variables instead")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise InvalidArgument(f"{REDIS_URL_ENV} path must be a database number, got {path!r}")
        return cls(host=parts.hostname, port=port, db=int(path or 0),
                   tls=parts.scheme == "rediss",
                   username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password else None)


@dataclass(frozen=True)
class ConnectionSettings:
    """How to reach and authenticate to Redis (or ElastiCache). Validated on creation.

    Attributes:
        url: ``redis://`` or ``rediss://`` URL (hidden from ``repr``: it may hold a password).
        cluster: use the cluster client (ElastiCache Serverless is always a cluster).
        socket_timeout_s: seconds to wait for a reply to one command.
        connect_timeout_s: seconds to wait for a TCP (and TLS) connection.
        retries: retries of a command after a connection error or timeout (0 = none).
        max_connections: connections per Redis node; one Lambda environment serves one
            request at a time, so this only bounds asyncio fan-out.
        health_check_interval_s: a connection idle longer than this is PINGed before use
            (catches sockets that died while the Lambda environment was frozen); 0 = never.
        tls_ca_file: PEM bundle to verify the server certificate (system CAs when None).
        auth: ``none`` (only what the URL holds), ``iam`` (ElastiCache IAM token) or
            ``secret`` (RBAC password from Secrets Manager).
        user: ElastiCache user id (required for ``iam``; optional for ``secret``).
        cache_name: serverless cache name or replication group id (``iam``).
        serverless: the cache is ElastiCache Serverless (``iam`` token resource type).
        secret_id: ARN or name of the Secrets Manager secret (``secret``).
        region: AWS region for signing and Secrets Manager.
        address: the parsed ``url`` (derived).
    """

    url: str = field(repr=False)
    cluster: bool = False
    socket_timeout_s: float = 0.5
    connect_timeout_s: float = 1.0
    retries: int = 1
    max_connections: int = 32
    health_check_interval_s: float = 30.0
    tls_ca_file: str | None = None
    auth: AuthMode = "none"
    user: str | None = None
    cache_name: str | None = None
    serverless: bool = True
    secret_id: str | None = None
    region: str | None = None
    address: RedisAddress = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        address = RedisAddress.parse(self.url)
        object.__setattr__(self, "address", address)
        _check_flag("cluster", self.cluster)
        _check_flag("serverless", self.serverless)
        _check_number(REDIS_SOCKET_TIMEOUT_ENV, self.socket_timeout_s, minimum=0.0, strict=True)
        _check_number(REDIS_CONNECT_TIMEOUT_ENV, self.connect_timeout_s, minimum=0.0, strict=True)
        _check_number(REDIS_HEALTH_CHECK_INTERVAL_ENV, self.health_check_interval_s, minimum=0.0)
        _check_int(REDIS_RETRIES_ENV, self.retries, 0, MAX_RETRIES)
        _check_int(REDIS_MAX_CONNECTIONS_ENV, self.max_connections, 1, 10_000)
        if self.auth not in AUTH_MODES:
            raise InvalidArgument(f"{REDIS_AUTH_ENV} must be one of {', '.join(AUTH_MODES)} "
                                  f"(got {self.auth!r})")
        if self.cluster and address.db != 0:
            raise InvalidArgument(f"{REDIS_URL_ENV} selects database {address.db}, "
                                  "but a Redis Cluster only has database 0")
        if self.auth != "none" and (address.username or address.password):
            raise InvalidArgument(f"{REDIS_URL_ENV} must not hold a user or password when "
                                  f"{REDIS_AUTH_ENV}={self.auth}; set {REDIS_USER_ENV} instead")
        if self.auth == "iam":
            _require(self, "iam", user=REDIS_USER_ENV, cache_name=ELASTICACHE_CACHE_NAME_ENV,
                     region=AWS_REGION_ENV)
            if not address.tls:
                raise InvalidArgument(f"{REDIS_AUTH_ENV}=iam needs TLS: ElastiCache accepts IAM "
                                      f"tokens only over rediss:// (check {REDIS_URL_ENV})")
        elif self.auth == "secret":
            _require(self, "secret", secret_id=REDIS_SECRET_ARN_ENV)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ConnectionSettings:
        """Read the settings from ``env`` (default ``os.environ``); overrides win.

        Args:
            env: the environment to read; ``os.environ`` when None.
            **overrides: field values that beat the environment; None means "not given".

        Returns:
            Validated, frozen settings.

        Raises:
            InvalidArgument: a variable or override is missing, malformed or inconsistent.
            TypeError: an override names no field.
        """
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown connection setting(s): {', '.join(unknown)}")
        source = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = source.get(name)
            return value.strip() if value is not None and value.strip() else None

        url = get(REDIS_URL_ENV)
        values: dict[str, Any] = {
            "url": url,
            "cluster": _parse_flag(REDIS_CLUSTER_ENV, get(REDIS_CLUSTER_ENV)),
            "socket_timeout_s": _parse_float(REDIS_SOCKET_TIMEOUT_ENV,
                                             get(REDIS_SOCKET_TIMEOUT_ENV)),
            "connect_timeout_s": _parse_float(REDIS_CONNECT_TIMEOUT_ENV,
                                              get(REDIS_CONNECT_TIMEOUT_ENV)),
            "retries": _parse_int(REDIS_RETRIES_ENV, get(REDIS_RETRIES_ENV)),
            "max_connections": _parse_int(REDIS_MAX_CONNECTIONS_ENV,
                                          get(REDIS_MAX_CONNECTIONS_ENV)),
            "health_check_interval_s": _parse_float(REDIS_HEALTH_CHECK_INTERVAL_ENV,
                                                    get(REDIS_HEALTH_CHECK_INTERVAL_ENV)),
            "tls_ca_file": get(REDIS_TLS_CA_FILE_ENV),
            "auth": (get(REDIS_AUTH_ENV) or "").lower() or None,
            "user": get(REDIS_USER_ENV),
            "cache_name": get(ELASTICACHE_CACHE_NAME_ENV),
            "serverless": _parse_flag(ELASTICACHE_SERVERLESS_ENV, get(ELASTICACHE_SERVERLESS_ENV)),
            "secret_id": get(REDIS_SECRET_ARN_ENV),
            "region": get(AWS_REGION_ENV) or get(AWS_DEFAULT_REGION_ENV),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["url"] is None:
            raise InvalidArgument(f"{REDIS_URL_ENV} is not set (e.g. redis://127.0.0.1:6379/0)")
        return cls(**{k: v for k, v in values.items() if v is not None})


def _parse_flag(name: str, raw: str | None) -> bool | None:
    if raw is None:
        return None
    text = raw.lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgument(f"{name} must be true or false (got {raw!r})")


def _parse_float(name: str, raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise InvalidArgument(f"{name} must be a number of seconds (got {raw!r})") from None


def _parse_int(name: str, raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"{name} must be a whole number (got {raw!r})") from None


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a bool (got {value!r})")


def _check_number(name: str, value: object, *, minimum: float, strict: bool = False) -> None:
    ok = (isinstance(value, int | float) and not isinstance(value, bool)
          and math.isfinite(value) and (value > minimum if strict else value >= minimum))
    if not ok:
        bound = "greater than" if strict else "at least"
        raise InvalidArgument(f"{name} must be a finite number {bound} {minimum:g} (got {value!r})")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(f"{name} must be a whole number from {low} to {high} "
                              f"(got {value!r})")


def _require(settings: ConnectionSettings, mode: str, **env_of_field: str) -> None:
    missing = [env for fld, env in env_of_field.items() if not getattr(settings, fld)]
    if missing:
        raise InvalidArgument(f"{REDIS_AUTH_ENV}={mode} needs {', '.join(missing)}")
