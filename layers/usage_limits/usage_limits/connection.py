"""The Redis client of one Lambda execution environment, configured from the environment.

``redis_from_env()`` returns a ``redis.asyncio.Redis`` (or ``RedisCluster`` when
``REDIS_CLUSTER=true``) with every timeout, retry and pool limit set explicitly: redis-py's
own defaults (5 s timeouts, 10 retries) would let one slow Redis eat a whole request. A
retried command may run twice on the server; that is safe because every ledger and
throttle script is idempotent per request id.

Authentication (``REDIS_AUTH``):

- ``none``: whatever the URL holds (``redis://user:password@host``), or nothing.
- ``iam``: ``ElastiCacheIAMProvider`` signs a short-lived ElastiCache IAM token with the
  function's AWS credentials (SigV4, no network call) and renews it before it expires.
- ``secret``: an RBAC password read once per execution environment from Secrets Manager.

Errors: configuration mistakes (bad variables, missing secret, secret without a password,
access denied) raise ``InvalidArgument``; AWS being unreachable, throttling or failing
raises ``LimiterUnavailable`` (fail closed, try again later).

boto3 and botocore are imported only when ``iam`` or ``secret`` is used: cold start matters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from .config import ConnectionSettings
from .exceptions import InvalidArgument, LimiterUnavailable

if TYPE_CHECKING:
    from botocore.credentials import Credentials

__all__ = [
    "CachedTokenProvider",
    "ElastiCacheIAMProvider",
    "clear_secret_cache",
    "read_redis_secret",
    "redis_from_env",
]

#: Retry backoff: random in [0, 10 ms * 2**failures], never more than 100 ms.
BACKOFF_BASE_S = 0.01
BACKOFF_CAP_S = 0.1
#: ElastiCache rejects IAM tokens older than 15 minutes; renew well before that.
IAM_TOKEN_EXPIRES_S = 900
IAM_TOKEN_REFRESH_S = 600.0
#: Secrets Manager calls get short timeouts and one retry (botocore's default is 60 s).
SECRETS_CONNECT_TIMEOUT_S = 2.0
SECRETS_READ_TIMEOUT_S = 3.0
SECRETS_MAX_ATTEMPTS = 2


def redis_from_env(
    env: Mapping[str, str] | None = None,
    *,
    settings: ConnectionSettings | None = None,
    credential_provider: CredentialProvider | None = None,
    url: str | None = None,
    cluster: bool | None = None,
    socket_timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    retries: int | None = None,
    max_connections: int | None = None,
    health_check_interval_s: float | None = None,
    tls_ca_file: str | None = None,
    auth: str | None = None,
    user: str | None = None,
    cache_name: str | None = None,
    serverless: bool | None = None,
    secret_id: str | None = None,
    region: str | None = None,
    sync: bool = False,
) -> Any:
    """An async Redis client configured from the environment; arguments beat variables.

    Call it once per execution environment and reuse the client across invocations. It
    opens no connection (the first command does), except that ``REDIS_AUTH=secret`` reads
    the secret here, once per execution environment.

    Args:
        env: environment to read (``os.environ`` when None).
        settings: settings already built; then ``env`` and the other arguments must be unset.
        credential_provider: your own redis-py credential provider; it replaces whatever
            ``REDIS_AUTH`` would use (the URL must then hold no user or password).
        url, cluster, ..., region: explicit values for the fields of
            ``usage_limits.config.ConnectionSettings``; None means "read the environment".
        sync: return the blocking ``redis.Redis``/``redis.cluster.RedisCluster`` with the
            same settings (for libraries that need one, such as Powertools idempotency).

    Returns:
        ``redis.asyncio.cluster.RedisCluster`` when ``cluster`` is true, else
        ``redis.asyncio.Redis``; both return bytes (``decode_responses=False``).

    Raises:
        InvalidArgument: a setting is missing, malformed or inconsistent, or the secret is
            missing, unreadable by this role, or holds no password.
        LimiterUnavailable: Secrets Manager could not be reached or failed.
        TypeError: ``settings`` was combined with ``env`` or other arguments.
    """
    overrides = dict(url=url, cluster=cluster, socket_timeout_s=socket_timeout_s,
                     connect_timeout_s=connect_timeout_s, retries=retries,
                     max_connections=max_connections,
                     health_check_interval_s=health_check_interval_s, tls_ca_file=tls_ca_file,
                     auth=auth, user=user, cache_name=cache_name, serverless=serverless,
                     secret_id=secret_id, region=region)
    if settings is None:
        settings = ConnectionSettings.from_env(env, **overrides)
    elif env is not None or any(v is not None for v in overrides.values()):
        raise TypeError("pass either settings or env/arguments, not both")
    address = settings.address

    credentials: dict[str, Any] = {}
    if credential_provider is not None:
        if address.username or address.password:
            raise InvalidArgument("the Redis URL must not hold a user or password "
                                  "when a credential provider is given")
        credentials["credential_provider"] = credential_provider
    elif settings.auth == "iam":
        credentials["credential_provider"] = ElastiCacheIAMProvider(
            settings.user or "", settings.cache_name or "", settings.region or "",
            serverless=settings.serverless)
    elif settings.auth == "secret":
        username, password = read_redis_secret(settings.secret_id or "", settings.region)
        credentials.update(username=settings.user or username, password=password)
    else:
        credentials.update(username=address.username, password=address.password)

    common: dict[str, Any] = dict(
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        health_check_interval=settings.health_check_interval_s,
        # The asyncio client needs the asyncio Retry: given the blocking one, it awaits the
        # command outside the retry loop and never retries.
        retry=(Retry if sync else AsyncRetry)(
            ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
            settings.retries),
        max_connections=settings.max_connections,
        decode_responses=False,
        **credentials,
    )
    if address.tls:
        common.update(ssl_cert_reqs="required", ssl_check_hostname=True,
                      ssl_ca_certs=settings.tls_ca_file)

    if sync:
        return _sync_client(settings, common)

    if settings.cluster:
        # Exceeding max_connections on one node raises MaxConnectionsError in the cluster
        # client (it has no blocking pool); 32 per node is far above one request's fan-out.
        return RedisCluster(host=address.host, port=address.port, ssl=address.tls, **common)

    # A blocking pool: asyncio fan-out beyond max_connections waits for a free connection
    # (at most one connect plus one command) instead of failing.
    common.pop("max_connections")
    pool = BlockingConnectionPool(
        max_connections=settings.max_connections,
        timeout=settings.connect_timeout_s + settings.socket_timeout_s,
        connection_class=SSLConnection if address.tls else Connection,
        host=address.host, port=address.port, db=address.db,
        **common,
    )
    return Redis.from_pool(pool)


class CachedTokenProvider(CredentialProvider):
    """A redis-py credential provider that returns ``(username, token)`` and renews the token.

    The token is made by ``make_token`` on first use and again once ``refresh_after_s`` have
    passed (or the clock went backwards). Tokens only matter when a connection
    authenticates; open connections stay authenticated. The token is never logged or shown
    by ``repr``.

    Args:
        username: the user to authenticate as.
        make_token: returns a fresh token (called with the lock held, so at most one runs).
        refresh_after_s: age after which a new token is made.
        clock: wall-clock seconds (token expiry is wall time on the server's side).
    """

    def __init__(self, username: str, make_token: Callable[[], str], *,
                 refresh_after_s: float = IAM_TOKEN_REFRESH_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not username:
            raise InvalidArgument("a token credential provider needs a username")
        if not refresh_after_s > 0:
            raise InvalidArgument(f"refresh_after_s must be positive (got {refresh_after_s!r})")
        self.username = username
        self.refresh_after_s = refresh_after_s
        self._make_token = make_token
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._made_at = 0.0

    def get_credentials(self) -> tuple[str, str]:
        """The username and a token younger than ``refresh_after_s``.

        Returns:
            ``(username, token)``.

        Raises:
            AuthenticationError: the token could not be made (a redis error, so redis-py
                closes the half-open connection; the script layer reports it as
                ``LimiterUnavailable``).
        """
        with self._lock:
            now = self._clock()
            age = now - self._made_at
            if self._token is None or age >= self.refresh_after_s or age < 0:
                try:
                    token = self._make_token()
                except Exception as exc:
                    raise AuthenticationError(
                        f"could not make an auth token for user {self.username!r}: "
                        f"{type(exc).__name__}: {exc}") from exc
                self._token, self._made_at = token, now
            return self.username, self._token

    async def get_credentials_async(self) -> tuple[str, str]:
        """Same as ``get_credentials`` (making a token is local CPU work, no I/O)."""
        return self.get_credentials()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(username={self.username!r})"


class ElastiCacheIAMProvider(CachedTokenProvider):
    """ElastiCache IAM authentication: the token is a SigV4-presigned ``connect`` request.

    The token is ``<cache_name>/?Action=connect&User=<user_id>[&ResourceType=ServerlessCache]``
    presigned for service ``elasticache`` in ``region`` for 900 s, without the scheme.
    Signing is local (no network call). ElastiCache requires TLS for IAM users, and the
    ElastiCache user id and user name must be the same. The function's role needs
    ``elasticache:Connect`` on both the cache and the user.

    Args:
        user_id: the ElastiCache user id (IAM authentication mode).
        cache_name: the serverless cache name, or the replication group id.
        region: the cache's AWS region.
        serverless: add ``ResourceType=ServerlessCache`` (required for serverless caches).
        credentials: botocore credentials; the default chain's when None.
        refresh_after_s: token age after which a new one is signed (tokens live 900 s).
        clock: wall-clock seconds, injectable for tests.

    Raises:
        InvalidArgument: an empty argument, or no AWS credentials found.
    """

    def __init__(self, user_id: str, cache_name: str, region: str, *, serverless: bool = True,
                 credentials: Credentials | None = None,
                 refresh_after_s: float = IAM_TOKEN_REFRESH_S,
                 clock: Callable[[], float] = time.time) -> None:
        for name, value in (("user_id", user_id), ("cache_name", cache_name), ("region", region)):
            if not value:
                raise InvalidArgument(f"ElastiCache IAM authentication needs a {name}")
        if not refresh_after_s < IAM_TOKEN_EXPIRES_S:
            raise InvalidArgument(f"refresh_after_s must be below {IAM_TOKEN_EXPIRES_S} s "
                                  f"(got {refresh_after_s!r})")
        super().__init__(user_id, self._sign, refresh_after_s=refresh_after_s, clock=clock)
        self.cache_name = cache_name
        self.region = region
        self.serverless = serverless
        self._credentials = credentials if credentials is not None else _default_credentials()

    def _sign(self) -> str:
        from botocore.auth import SigV4QueryAuth
        from botocore.awsrequest import AWSRequest

        params = {"Action": "connect", "User": self.username}
        if self.serverless:
            params["ResourceType"] = "ServerlessCache"
        request = AWSRequest(method="GET", url=f"http://{self.cache_name}/", params=params)
        signer = SigV4QueryAuth(self._credentials.get_frozen_credentials(), "elasticache",
                                self.region, expires=IAM_TOKEN_EXPIRES_S)
        with _quiet_signing():
            signer.add_auth(request)
        url: str = request.url
        return url.removeprefix("http://")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(user_id={self.username!r}, "
                f"cache_name={self.cache_name!r}, region={self.region!r}, "
                f"serverless={self.serverless!r})")


class _DropWhileSigning(logging.Filter):
    """Drops botocore.auth records while this thread signs a token.

    At DEBUG level botocore logs the canonical request and the signature, which together
    are the token (and any session token).
    """

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.active, "on", False)


_DROP_WHILE_SIGNING = _DropWhileSigning()


@contextlib.contextmanager
def _quiet_signing() -> Iterator[None]:
    logging.getLogger("botocore.auth").addFilter(_DROP_WHILE_SIGNING)  # once: a no-op after
    _DropWhileSigning.active.on = True
    try:
        yield
    finally:
        _DropWhileSigning.active.on = False


def _default_credentials() -> Credentials:
    import botocore.session

    credentials = botocore.session.get_session().get_credentials()
    if credentials is None:
        raise InvalidArgument("REDIS_AUTH=iam but no AWS credentials were found "
                              "(the Lambda role provides them in AWS)")
    return credentials


# --- Secrets Manager ------------------------------------------------------------------------
_secret_lock = threading.Lock()
_secrets: dict[tuple[str, str | None], tuple[str | None, str]] = {}
_clients: dict[str | None, Any] = {}


def read_redis_secret(secret_id: str, region: str | None = None) -> tuple[str | None, str]:
    """The Redis user and password in a Secrets Manager secret, read once per process.

    The secret string is either the password itself or a JSON object with ``password`` and
    an optional ``username``. The value is cached for the life of the execution environment
    (a rotated password is picked up by new environments).

    Args:
        secret_id: the secret's ARN or name.
        region: AWS region of Secrets Manager (boto3's default chain when None).

    Returns:
        ``(username or None, password)``.

    Raises:
        InvalidArgument: the secret does not exist, this role may not read it, or it holds
            no usable password.
        LimiterUnavailable: Secrets Manager could not be reached, throttled or failed.
    """
    key = (secret_id, region)
    with _secret_lock:
        cached = _secrets.get(key)
        if cached is None:
            cached = _parse_secret(secret_id, _fetch_secret_string(secret_id, region))
            _secrets[key] = cached
        return cached


def clear_secret_cache() -> None:
    """Forget cached secrets and Secrets Manager clients (tests, or after a rotation)."""
    with _secret_lock:
        _secrets.clear()
        _clients.clear()


def _secrets_client(region: str | None) -> Any:
    client = _clients.get(region)
    if client is None:
        import boto3
        from botocore.config import Config

        config = Config(connect_timeout=SECRETS_CONNECT_TIMEOUT_S,
                        read_timeout=SECRETS_READ_TIMEOUT_S,
                        retries={"total_max_attempts": SECRETS_MAX_ATTEMPTS, "mode": "standard"})
        client = boto3.session.Session().client("secretsmanager", region_name=region,
                                                config=config)
        _clients[region] = client
    return client


_CONFIG_ERRORS = frozenset({"ResourceNotFoundException", "AccessDeniedException",
                            "InvalidParameterException", "InvalidRequestException",
                            "DecryptionFailure", "UnrecognizedClientException"})


def _fetch_secret_string(secret_id: str, region: str | None) -> str:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        response = _secrets_client(region).get_secret_value(SecretId=secret_id)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in _CONFIG_ERRORS:
            raise InvalidArgument(f"cannot read Redis secret {secret_id!r}: {code}") from exc
        raise LimiterUnavailable(f"Secrets Manager failed reading {secret_id!r}: {code}") from exc
    except BotoCoreError as exc:
        raise LimiterUnavailable(
            f"Secrets Manager unreachable reading {secret_id!r}: {type(exc).__name__}") from exc
    text = response.get("SecretString")
    if not isinstance(text, str):
        raise InvalidArgument(f"Redis secret {secret_id!r} has no SecretString")
    return text


def _parse_secret(secret_id: str, text: str) -> tuple[str | None, str]:
    """Plain string = the password; a JSON object = ``password`` (+ optional ``username``)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        if not text:
            raise InvalidArgument(f"Redis secret {secret_id!r} is empty")
        return None, text
    password, username = data.get("password"), data.get("username")
    if not isinstance(password, str) or not password:
        raise InvalidArgument(f"Redis secret {secret_id!r} is JSON without a 'password' string")
    if username is not None and not isinstance(username, str):
        raise InvalidArgument(f"Redis secret {secret_id!r} has a non-string 'username'")
    return username or None, password


def _sync_client(settings: ConnectionSettings, common: dict[str, Any]) -> Any:
    """The blocking client with the same timeouts, retries, TLS and credentials."""
    import redis
    import redis.cluster

    address = settings.address
    if settings.cluster:
        return redis.cluster.RedisCluster(host=address.host, port=address.port, ssl=address.tls,
                                          **common)
    common = dict(common)
    max_connections = common.pop("max_connections")
    # redis-py leaves the sync pool's __init__ unannotated.
    pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
        max_connections=max_connections,
        timeout=settings.connect_timeout_s + settings.socket_timeout_s,
        host=address.host, port=address.port, db=address.db,
        **({"connection_class": redis.SSLConnection} if address.tls else {}),
        **common,
    )
    return redis.Redis.from_pool(pool)
