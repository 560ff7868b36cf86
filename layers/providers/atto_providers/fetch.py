"""Safe fetching of public web pages: the ``pages`` provider of job extraction.

A URL from a user is untrusted. Fetched naively it reaches whatever its host resolves to:
the instance metadata service (169.254.169.254), the VPC, the cache, localhost (SSRF).
``PageFetcher.fetch(url)`` fetches a page only when every rule below holds, for the URL
and again for every redirect hop, and refuses anything else with a 400
``invalid_request`` whose ``reason`` says why (the web layer refunds every 4xx):

=============================  ==========================================================
reason                         refused when
=============================  ==========================================================
``invalid_url``                unparsable, no host, a host that is neither a DNS name nor
                               an IP address, a port outside 1..65535, over 2048 chars
``unsupported_scheme``         not ``http``/``https`` (``file:``, ``ftp:``, ``data:``, ...)
``credentials_in_url``         ``user:password@`` in the URL
``private_address``            the host is ``localhost``, or ANY address it resolves to is
                               not public (see ``is_public_address``); numeric hosts such
                               as ``2130706433``, ``0x7f.1`` or ``017700000001`` are read
                               the way browsers read them (WHATWG) and checked the same way
``port_not_allowed``           a port other than 80 and 443 (see below)
``unresolvable_host``          the name does not resolve
``redirect_loop``              a redirect leads back to a URL already fetched
``too_many_redirects``         more than ``max_redirects`` (5) redirects
``too_large``                  over ``max_bytes`` (2 MiB): by Content-Length, or counted
                               while streaming (reading stops at the cap)
``unsupported_content_type``   not ``text/html``, ``text/plain`` or ``application/xhtml+xml``
``unsupported_content_encoding`` compressed other than gzip/deflate (we ask for identity)
=============================  ==========================================================

Failures of the page itself are 502 ``provider_error`` with ``provider: "pages"``
(refunded too): ``timeout`` (the whole fetch, redirects included, takes longer than
min(``max_time_s`` = 10 s, the request's deadline)), ``unreachable`` (connect, TLS or
protocol error), ``upstream_status`` (an answer other than 2xx or a redirect) and
``bad_redirect`` (a redirect without Location). A site's 429 is 503 ``provider_busy``
with its Retry-After, without pausing other sites: the shared pause is for providers we
have a contract with, and one site's limit says nothing about another's.

Addresses are pinned (no DNS rebinding). The host is resolved once per hop with
``getaddrinfo`` in a worker thread (bounded by the deadline), every address is checked,
and the connection is made to those checked addresses by a custom ``httpcore`` network
backend that ignores the host name it is given. The URL itself is not rewritten: the Host
header, TLS SNI and certificate verification all use the URL's host name, so a name that
resolves to a public address at check time and to 127.0.0.1 a moment later still connects
to the public address. No proxy from the environment is used.

Ports: only 80 and 443. The functions' security groups let nothing else out (see
template.yaml), so another port could only hang until the timeout; refusing it up front
gives a clear answer, and it keeps the fetcher from being a port scanner of public hosts.

Local development: the offline emulator listens on 127.0.0.1, which is not public.
``PAGES_ALLOW_PRIVATE_HOSTS`` (comma-separated IP addresses or CIDR networks, e.g.
``127.0.0.1,::1``) lists addresses that are fetched anyway, on any port; it is honoured
ONLY when ``ATTO_ENV=local`` and ignored (with a warning) everywhere else. Tests may pass
their own ``FetchPolicy`` instead.

Every fetch of a page (each redirect hop) takes a slot of the shared ``pages`` throttle
(``PAGES_RATE``, default 2/s; ``PAGES_BURST``; ``PAGES_CONCURRENCY``).
"""

from __future__ import annotations

import asyncio
import codecs
import ipaddress
import logging
import re
import socket
import ssl
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpcore
import httpx

from usage_limits.deadline import deadline_scope, remaining_s
from usage_limits.exceptions import InvalidArgument, ProviderBusy
from usage_limits.web import observability as obs
from usage_limits.web.errors import InvalidRequest, ProviderError

from .base import MIN_CALL_S, ProviderClient

log = logging.getLogger("atto_providers.fetch")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: An async function from (host, port) to the host's addresses (as text).
Resolver = Callable[[str, int], Awaitable[list[str]]]

ENV_ALLOW_PRIVATE = "PAGES_ALLOW_PRIVATE_HOSTS"
MAX_URL_CHARS = 2048
USER_AGENT = b"AttoCloud-JobExtraction/1.0 (+https://atto.cloud)"
ACCEPT = b"text/html,application/xhtml+xml,text/plain;q=0.9"
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}

#: Networks refused on top of what ``ipaddress`` says is not global (belt and braces: some
#: of these count as "global" in some Python versions, e.g. multicast and 6to4).
_BLOCKED: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
    "240.0.0.0/4", "::/96", "::ffff:0:0/96", "64:ff9b:1::/48", "100::/64", "2001:db8::/32",
    "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_NUMERIC_LABEL = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_:.-]{1,40})""", re.I)


# ----------------------------------------------------------------------------------------
# Errors and results
# ----------------------------------------------------------------------------------------

class PageRefused(InvalidRequest):
    """A URL or a page that the rules refuse: 400 ``invalid_request`` with ``reason``."""

    def __init__(self, reason: str, message: str, **extra: Any) -> None:
        super().__init__(message, reason=reason, **extra)
        self.reason = reason


def _page_error(reason: str, message: str, **extra: Any) -> ProviderError:
    return ProviderError(message, provider="pages", reason=reason, **extra)


@dataclass(frozen=True)
class Page:
    """A fetched page.

    Attributes:
        url: the URL the content came from (after redirects).
        status: its HTTP status (2xx).
        content_type: the media type, lower case, without parameters.
        text: the body decoded to text (charset from the header, a ``<meta>``, else UTF-8).
        redirects: the URLs that redirected, in order.
    """

    url: str
    status: int
    content_type: str
    text: str
    redirects: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """A URL that passed the checks that need no DNS.

    Attributes:
        url: the parsed URL (fragment removed).
        scheme: ``http`` or ``https``.
        host: the host as sent in Host and SNI: ASCII (IDNA), no trailing dot, IPv6
            without brackets.
        port: the port, explicit or the scheme's default.
        literal: the host's address when the host is an IP address (numeric forms read).
    """

    url: httpx.URL
    scheme: str
    host: str
    port: int
    literal: IPAddress | None

    @property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port != DEFAULT_PORTS[self.scheme]:
            host = f"{host}:{self.port}"
        return host.encode("ascii")


@dataclass(frozen=True)
class _Redirect:
    location: str


# ----------------------------------------------------------------------------------------
# Address policy
# ----------------------------------------------------------------------------------------

def is_public_address(ip: IPAddress) -> bool:
    """True when ``ip`` is a public unicast address.

    Refused: loopback, private (RFC 1918), shared/CGNAT (100.64/10), link-local
    (169.254/16 with the metadata address, fe80::/10), unique-local (fc00::/7), site-local,
    unspecified, multicast, reserved, documentation and benchmarking ranges, and IPv6
    forms that embed a refused IPv4 address (IPv4-mapped, IPv4-compatible, 6to4, NAT64,
    Teredo).
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return False
        embedded: list[ipaddress.IPv4Address] = []
        if ip.ipv4_mapped is not None:
            embedded.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            embedded.append(ip.sixtofour)
        if ip.teredo is not None:
            embedded.extend(ip.teredo)
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if any(not is_public_address(v4) for v4 in embedded):
            return False
        if ip.is_site_local:
            return False
    if (not ip.is_global or ip.is_private or ip.is_loopback or ip.is_link_local
            or ip.is_multicast or ip.is_reserved or ip.is_unspecified):
        return False
    return not any(ip.version == net.version and ip in net for net in _BLOCKED)


@dataclass(frozen=True)
class FetchPolicy:
    """The limits of one fetcher.

    Attributes:
        max_bytes: largest body read (after decompression).
        max_time_s: longest fetch, redirects included (also capped by the deadline).
        max_redirects: redirects followed.
        ports: ports allowed for public addresses.
        content_types: media types accepted.
        allow_private: networks fetched although not public, on any port (local only).
    """

    max_bytes: int = 2 * 1024 * 1024
    max_time_s: float = 10.0
    max_redirects: int = 5
    ports: frozenset[int] = frozenset({80, 443})
    content_types: frozenset[str] = frozenset({"text/html", "text/plain",
                                               "application/xhtml+xml"})
    allow_private: tuple[IPNetwork, ...] = field(default=())

    def allowlisted(self, ip: IPAddress) -> bool:
        """True when ``ip`` is in ``allow_private``."""
        return any(ip.version == net.version and ip in net for net in self.allow_private)

    def address_allowed(self, ip: IPAddress) -> bool:
        """True when ``ip`` is public or allowlisted."""
        return is_public_address(ip) or self.allowlisted(ip)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> FetchPolicy:
        """The default policy, plus ``PAGES_ALLOW_PRIVATE_HOSTS`` when ``ATTO_ENV=local``.

        Raises:
            InvalidArgument: the allowlist has an entry that is not an address or network.
        """
        raw = env.get(ENV_ALLOW_PRIVATE, "").strip()
        if not raw:
            return cls()
        if env.get("ATTO_ENV", "").strip().lower() != "local":
            log.warning("%s is ignored: it is honoured only when ATTO_ENV=local",
                        ENV_ALLOW_PRIVATE)
            return cls()
        networks = []
        for entry in filter(None, (e.strip() for e in raw.split(","))):
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise InvalidArgument(f"{ENV_ALLOW_PRIVATE}: {entry!r} is not an IP address "
                                      "or network") from None
        return cls(allow_private=tuple(networks))


# ----------------------------------------------------------------------------------------
# URL checks (no I/O)
# ----------------------------------------------------------------------------------------

def _ipv4_number_form(host: str) -> ipaddress.IPv4Address | None:
    """The address of a numeric IPv4 host in any form browsers accept, else None.

    ``2130706433``, ``0x7f000001``, ``017700000001``, ``0x7f.1`` and ``127.1`` are all
    127.0.0.1 (WHATWG URL "IPv4 parser": each part decimal, 0x-hex or 0-octal; the last
    part fills the remaining bytes).

    Raises:
        ValueError: the host ends in a number but is not a valid IPv4 address.
    """
    parts = host.split(".")
    if not _NUMERIC_LABEL.fullmatch(parts[-1]):
        return None
    if len(parts) > 4:
        raise ValueError("too many parts")
    numbers = []
    for part in parts:
        if part[:2].lower() == "0x":
            numbers.append(int(part[2:] or "0", 16))
        elif len(part) > 1 and part.startswith("0"):
            numbers.append(int(part[1:], 8))
        elif part.isdigit():
            numbers.append(int(part))
        else:
            raise ValueError(f"{part!r} is not a number")
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        raise ValueError("a part is out of range")
    value = numbers[-1]
    for i, n in enumerate(numbers[:-1]):
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def check_url(url: str) -> Target:
    """The checks that need no DNS: syntax, scheme, credentials, host form, port range.

    Raises:
        PageRefused: ``invalid_url``, ``unsupported_scheme``, ``credentials_in_url`` or
            ``private_address`` (``localhost`` and IP literals that are not public are
            refused by ``PageFetcher`` after this, together with resolved names).
    """
    text = url.strip()
    if not text or len(text) > MAX_URL_CHARS or any(ord(c) < 0x21 or c == "\x7f" for c in text):
        raise PageRefused("invalid_url", "the URL is not a valid http or https URL")
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise PageRefused("invalid_url", "the URL is not a valid http or https URL") from None
    scheme = parsed.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise PageRefused("unsupported_scheme", "only http and https URLs can be fetched",
                          scheme=scheme[:20])
    if parsed.userinfo:
        raise PageRefused("credentials_in_url",
                          "URLs with a user name or password are not fetched")
    try:
        host = parsed.raw_host.decode("ascii").lower()
    except UnicodeDecodeError:
        raise PageRefused("invalid_url", "the URL's host is malformed") from None
    port = parsed.port if parsed.port is not None else DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise PageRefused("invalid_url", "the URL's port is out of range")
    literal: IPAddress | None = None
    if ":" in host:
        try:
            literal = ipaddress.IPv6Address(host)
        except ValueError:
            raise PageRefused("invalid_url", "the URL's host is malformed") from None
        if literal.scope_id:
            raise PageRefused("invalid_url", "the URL's host is malformed")
    else:
        host = host[:-1] if host.endswith(".") else host
        if not host or len(host) > 253:
            raise PageRefused("invalid_url", "the URL has no valid host")
        try:
            literal = _ipv4_number_form(host)
        except ValueError:
            raise PageRefused("invalid_url", "the URL's host is malformed") from None
        if literal is not None:
            host = str(literal)
        elif not all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):
            raise PageRefused("invalid_url", "the URL's host is malformed")
        elif host == "localhost" or host.endswith(".localhost"):
            raise PageRefused("private_address", "the URL's address is not public")
    return Target(url=parsed.copy_with(fragment=None), scheme=scheme, host=host, port=port,
                  literal=literal)


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address of ``host`` (``getaddrinfo`` in the loop's worker thread).

    Raises:
        socket.gaierror: the name does not resolve.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


# ----------------------------------------------------------------------------------------
# Connections pinned to checked addresses
# ----------------------------------------------------------------------------------------

class PinnedBackend(httpcore.AsyncNetworkBackend):
    """An ``httpcore`` network backend that connects only to the given addresses.

    ``httpcore`` calls ``connect_tcp`` with the URL's host; this backend ignores the host
    and tries the checked addresses in order, so no second DNS lookup can change where the
    connection goes. TLS (SNI and certificate checks) still uses the URL's host name,
    because ``httpcore`` passes it to ``start_tls`` itself.
    """

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise InvalidArgument("PinnedBackend needs at least one address")
        self._addresses = tuple(addresses)
        self._backend = httpcore.AnyIOBackend()

    # The signatures are httpcore's interface, ``timeout`` parameters included.
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        error: Exception | None = None
        for address in self._addresses:
            try:
                return await self._backend.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address,
                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error or httpcore.ConnectError("no address to connect to")

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("pages are never fetched over unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


_ssl: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    """The TLS context (certifi's CA bundle, as httpx uses), made once per process."""
    global _ssl
    if _ssl is None:
        import certifi

        _ssl = ssl.create_default_context(cafile=certifi.where())
    return _ssl


class _Inflater:
    """Bounded gzip/deflate decoding: never yields more than it is asked for."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._zlib: Any = None
        if encoding in ("gzip", "x-gzip"):
            self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._zlib = zlib.decompressobj(zlib.MAX_WBITS)

    def feed(self, chunk: bytes, room: int) -> bytes:
        """Up to ``room`` decoded bytes of ``chunk`` (more pending means "too large")."""
        if self._zlib is None:
            return chunk[:room] if len(chunk) > room else chunk
        try:
            out: bytes = self._zlib.decompress(self._zlib.unconsumed_tail + chunk, room)
        except zlib.error as exc:
            raise _page_error("unreachable", "the page's compressed body is corrupt") from exc
        if self._zlib.unconsumed_tail and len(out) < room:
            out += self._zlib.decompress(self._zlib.unconsumed_tail, room - len(out))
        return out


def _charset(content_type: str, head: bytes) -> str:
    match = re.search(r"charset\s*=\s*\"?([A-Za-z0-9_:.-]{1,40})", content_type, re.I)
    meta = _META_CHARSET.search(head)
    for candidate in (match.group(1) if match else None,
                      meta.group(1).decode("ascii") if meta else None):
        if candidate:
            try:
                return codecs.lookup(candidate).name
            except LookupError:
                continue
    return "utf-8"


# ----------------------------------------------------------------------------------------
# The fetcher
# ----------------------------------------------------------------------------------------

class PageFetcher(ProviderClient):
    """Fetches public web pages under the rules of this module, throttled as ``pages``.

    Args:
        policy: the limits; default ``FetchPolicy.from_env(env)``.
        resolver: how names are resolved; default ``resolve_host`` (tests replace it).
        env, redis: as ``ProviderClient``.
    """

    name: ClassVar[str] = "pages"
    default_rate: ClassVar[str] = "2/s"
    default_burst: ClassVar[int] = 2

    def __init__(self, *, policy: FetchPolicy | None = None, resolver: Resolver | None = None,
                 env: Mapping[str, str] | None = None, redis: Any = None) -> None:
        super().__init__("", env=env, redis=redis)
        self.policy = policy if policy is not None else FetchPolicy.from_env(self.env)
        self.resolver = resolver

    async def fetch(self, url: str) -> Page:
        """Fetch ``url``, following up to ``max_redirects`` redirects, each one checked.

        Raises:
            PageRefused: a rule refuses the URL, a redirect or the page (400).
            ProviderError: the page timed out, could not be reached or failed (502).
            ProviderBusy: no ``pages`` slot in time, or the site answered 429 (503).
        """
        budget = min(self.policy.max_time_s, remaining_s())
        if budget < MIN_CALL_S:
            raise ProviderBusy(self.name, 1.0, "no time left to fetch the page")
        with deadline_scope(budget):
            try:
                async with asyncio.timeout(budget):
                    return await self._follow(url)
            except ProviderBusy:
                obs.provider_count(self.name, obs.PROVIDER_BUSY)
                raise
            except TimeoutError:
                raise _page_error("timeout", f"the page did not arrive within {budget:.1f}s",
                                  ) from None

    async def check(self, url: str) -> tuple[Target, list[str]]:
        """Every check of one hop, DNS included: the target and its allowed addresses.

        Raises:
            PageRefused: as ``fetch``.
        """
        target = check_url(url)
        if target.literal is not None:
            addresses: list[IPAddress] = [target.literal]
        elif target.port not in self.policy.ports and not self.policy.allow_private:
            raise self._port_refused()  # before any lookup
        else:
            addresses = await self._resolve(target)
        if not all(self.policy.address_allowed(ip) for ip in addresses):
            raise PageRefused("private_address", "the URL's address is not public")
        if target.port not in self.policy.ports and not all(
                self.policy.allowlisted(ip) for ip in addresses):
            raise self._port_refused()
        ordered = sorted(addresses, key=lambda ip: ip.version)  # IPv4 first: VPCs lack v6
        return target, [str(ip) for ip in ordered]

    def _port_refused(self) -> PageRefused:
        ports = " and ".join(map(str, sorted(self.policy.ports)))
        return PageRefused("port_not_allowed", f"only ports {ports} can be fetched")

    async def _resolve(self, target: Target) -> list[IPAddress]:
        resolver = self.resolver or resolve_host
        try:
            names = await resolver(target.host, target.port)
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN:
                raise _page_error("unreachable", "the URL's host could not be resolved now",
                                  ) from None
            raise PageRefused("unresolvable_host", "the URL's host name does not resolve",
                              ) from None
        except OSError:
            raise _page_error("unreachable", "the URL's host could not be resolved") from None
        addresses = []
        for name in names:
            try:
                addresses.append(ipaddress.ip_address(name))
            except ValueError:
                # e.g. a link-local address with a zone: never public anyway
                raise PageRefused("private_address", "the URL's address is not public",
                                  ) from None
        if not addresses:
            raise PageRefused("unresolvable_host", "the URL's host name does not resolve")
        return addresses

    async def _follow(self, url: str) -> Page:
        fetched: list[str] = []
        current = url
        for hop in range(self.policy.max_redirects + 1):
            try:
                target, addresses = await self.check(current)
            except PageRefused as exc:
                if hop:
                    exc.message = f"redirect {hop}: {exc.message}"
                    exc.extra["redirects"] = hop
                raise
            result = await self._get(target, addresses)
            fetched.append(str(target.url))
            if isinstance(result, Page):
                return Page(result.url, result.status, result.content_type, result.text,
                            redirects=tuple(fetched[:-1]))
            try:
                current = str(target.url.join(result.location).copy_with(fragment=None))
            except (httpx.InvalidURL, ValueError, TypeError):
                raise _page_error("bad_redirect", "the page redirects to an invalid URL",
                                  ) from None
            if current in fetched:
                raise PageRefused("redirect_loop", "the page redirects in a loop",
                                  redirects=hop + 1)
        raise PageRefused("too_many_redirects",
                          f"the page redirects more than {self.policy.max_redirects} times",
                          redirects=self.policy.max_redirects + 1)

    async def _get(self, target: Target, addresses: list[str]) -> Page | _Redirect:
        request_url = httpcore.URL(scheme=target.scheme.encode(), host=target.host.encode(),
                                   port=target.port, target=target.url.raw_path)
        headers = [(b"Host", target.host_header), (b"User-Agent", USER_AGENT),
                   (b"Accept", ACCEPT), (b"Accept-Encoding", b"identity"),
                   (b"Connection", b"close")]
        async with self.throttle.slot() as waited_s:
            left = remaining_s()
            if left < MIN_CALL_S:
                raise _page_error("timeout", "no time left to fetch the page")
            obs.provider_count(self.name, obs.PROVIDER_CALLS)
            obs.provider_count(self.name, obs.PROVIDER_WAIT_MS, round(waited_s * 1000, 3),
                               unit="Milliseconds")
            timeouts = {"connect": left, "read": left, "write": left, "pool": left}
            pool = httpcore.AsyncConnectionPool(
                ssl_context=_ssl_context(), network_backend=PinnedBackend(addresses),
                max_connections=1, http1=True, http2=False, retries=0)
            try:
                async with pool, pool.stream("GET", request_url, headers=headers,
                                             extensions={"timeout": timeouts}) as response:
                    return await self._read(target, response)
            except httpcore.TimeoutException:
                raise _page_error("timeout", "the page did not arrive in time") from None
            except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.ProxyError,
                    httpcore.UnsupportedProtocol, ssl.SSLError, OSError) as exc:
                log.info("page at %s unreachable: %s", target.host, type(exc).__name__)
                raise _page_error("unreachable", "the page could not be reached") from None

    async def _read(self, target: Target, response: httpcore.Response) -> Page | _Redirect:
        status = response.status
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in response.headers}
        if status in REDIRECT_STATUSES:
            location = headers.get("location", "").strip()
            if not location:
                raise _page_error("bad_redirect", "the page redirects without a Location")
            return _Redirect(location)
        if status == 429:
            obs.provider_count(self.name, obs.UPSTREAM_429)
            try:
                wait = min(60.0, max(1.0, float(headers.get("retry-after", "1"))))
            except ValueError:
                wait = 1.0
            raise ProviderBusy(self.name, wait, "the page's site is rate limiting us")
        if not 200 <= status < 300:
            raise _page_error("upstream_status", f"the page answered {status}",
                              upstream_status=status)
        content_type = headers.get("content-type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if media not in self.policy.content_types:
            raise PageRefused("unsupported_content_type", "the page is not HTML or plain text",
                              content_type=media[:100] or None)
        cap = self.policy.max_bytes
        length = headers.get("content-length", "").strip()
        too_large = PageRefused("too_large", f"the page is larger than {cap} bytes",
                                limit_bytes=cap)
        if length.isdigit() and int(length) > cap:
            raise too_large
        encoding = headers.get("content-encoding", "identity").strip().lower() or "identity"
        if encoding not in ("identity", "gzip", "x-gzip", "deflate"):
            raise PageRefused("unsupported_content_encoding",
                              "the page's content encoding is not supported")
        inflater = _Inflater(encoding)
        body = bytearray()
        async for chunk in response.aiter_stream():
            body += inflater.feed(chunk, cap + 1 - len(body))
            if len(body) > cap:
                raise too_large
        text = bytes(body).decode(_charset(content_type, bytes(body[:4096])), errors="replace")
        return Page(url=str(target.url), status=status, content_type=media, text=text)


_fetcher: PageFetcher | None = None


def page_fetcher() -> PageFetcher:
    """The process's page fetcher (settings read once)."""
    global _fetcher
    if _fetcher is None:
        _fetcher = PageFetcher()
    return _fetcher
