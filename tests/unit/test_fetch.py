"""The safe-fetch rules that need no network: URL checks, address policy, pinning inputs."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from atto_providers.fetch import (
    ENV_ALLOW_PRIVATE,
    FetchPolicy,
    PageFetcher,
    PageRefused,
    check_url,
    is_public_address,
)
from usage_limits.exceptions import InvalidArgument

#: What a resolver returns for each test host name.
DNS: dict[str, list[str]] = {
    "jobs.example": ["93.184.216.34"],
    "dual.example": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"],
    "internal.example": ["10.0.0.5"],
    "metadata.example": ["169.254.169.254"],
    "mixed.example": ["93.184.216.34", "192.168.1.10"],
    "loopback6.example": ["::1"],
    "mapped.example": ["::ffff:127.0.0.1"],
    "zone.example": ["fe80::1%eth0"],
}


class Resolver:
    """A fake resolver that records its calls and answers from ``DNS``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host not in DNS:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return DNS[host]


@pytest.fixture
def resolver() -> Resolver:
    """A fresh fake resolver."""
    return Resolver()


@pytest.fixture
def fetcher(resolver: Resolver) -> PageFetcher:
    """A fetcher with the default policy and the fake resolver (no Redis, no network)."""
    return PageFetcher(policy=FetchPolicy(), resolver=resolver, env={})


async def refused(fetcher: PageFetcher, url: str) -> PageRefused:
    with pytest.raises(PageRefused) as info:
        await fetcher.check(url)
    error = info.value
    assert error.status == 400 and error.code == "invalid_request"
    assert error.extra["reason"] == error.reason
    return error


@pytest.mark.parametrize("url", [
    "file:///etc/passwd", "ftp://example.com/job", "data:text/html,<h1>x</h1>",
    "gopher://example.com:70/_x", "javascript:alert(1)", "dict://example.com:11211/",
    "ws://example.com/", "jar:http://example.com/x.jar!/", "HTTPX://example.com/",
])
async def test_only_http_and_https_schemes(fetcher: PageFetcher, url: str) -> None:
    """Every scheme but http and https is refused with unsupported_scheme."""
    assert (await refused(fetcher, url)).reason == "unsupported_scheme"


@pytest.mark.parametrize("url", [
    "", "   ", "http://", "http:///path", "http://exa mple.com/", "http://a..b/",
    "http://-bad.example/", "http://example.com:99999/", "http://[fe80::1%25eth0]/",
    "http://999.1.1.1/", "http://1.2.3.4.5/", "http://0x1g.1/", "http://09.1.1.1/",
    "http://example.com/\x00", "http://" + "a" * 2050 + ".com/", "//example.com/job",
    "http://0177.0.0.1/",  # a dotted quad with leading zeros: the URL parser refuses it
])
async def test_malformed_urls_are_invalid(fetcher: PageFetcher, url: str) -> None:
    """Unparsable URLs, bad hosts and ports and over-long URLs are invalid_url (or no scheme)."""
    assert (await refused(fetcher, url)).reason in ("invalid_url", "unsupported_scheme")


@pytest.mark.parametrize("url", [
    "http://user:secret@jobs.example/", "https://user@jobs.example/",
    "http://jobs.example\\@169.254.169.254/", "http://:pw@jobs.example/",
])
async def test_credentials_in_url_are_refused(fetcher: PageFetcher, url: str) -> None:
    """A user name or password in the URL is refused before any lookup."""
    assert (await refused(fetcher, url)).reason == "credentials_in_url"


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/", "http://127.0.0.1:8080/admin", "http://127.8.9.10/",
    "http://localhost/", "http://LOCALHOST./", "http://api.localhost/", "http://[::1]/",
    "http://0.0.0.0/", "http://0/", "http://2130706433/", "http://0x7f000001/",
    "http://017700000001/", "http://0x7f.1/", "http://127.1/",
    "http://[::]/", "http://[0:0:0:0:0:0:0:1]/",
])
async def test_loopback_names_and_numeric_forms_are_refused(
        fetcher: PageFetcher, resolver: Resolver, url: str) -> None:
    """Loopback, unspecified and every numeric spelling of 127.0.0.1 are private_address."""
    assert (await refused(fetcher, url)).reason == "private_address"
    assert resolver.calls == []  # literals and localhost never reach DNS


@pytest.mark.parametrize("host", [
    "10.0.0.1", "10.255.255.255", "172.16.0.1", "172.31.255.254", "192.168.1.1",
    "100.64.0.1", "100.127.255.254", "169.254.169.254", "169.254.0.1", "192.0.0.8",
    "198.18.0.1", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255",
    "192.0.2.10", "[fe80::1]", "[fc00::1]", "[fd12:3456::1]", "[fec0::1]", "[ff02::1]",
    "[::ffff:127.0.0.1]", "[::ffff:10.0.0.1]", "[::ffff:169.254.169.254]",
    "[::ffff:7f00:1]", "[::127.0.0.1]", "[2002:7f00:1::]", "[2002:a00:1::]",
    "[64:ff9b::a9fe:a9fe]", "[2001:db8::1]", "[100::1]",
])
async def test_private_and_special_ranges_are_refused(fetcher: PageFetcher, host: str) -> None:
    """RFC 1918, CGNAT, link-local and metadata, multicast, reserved and embedded forms."""
    assert (await refused(fetcher, f"http://{host}/job")).reason == "private_address"


@pytest.mark.parametrize("host", ["internal.example", "metadata.example", "mixed.example",
                                  "loopback6.example", "mapped.example", "zone.example"])
async def test_names_resolving_to_private_addresses_are_refused(
        fetcher: PageFetcher, resolver: Resolver, host: str) -> None:
    """A name is refused when ANY of its addresses is not public."""
    assert (await refused(fetcher, f"https://{host}/jobs/1")).reason == "private_address"
    assert resolver.calls == [(host, 443)]


async def test_public_name_is_pinned_to_its_checked_addresses(fetcher: PageFetcher) -> None:
    """A public name passes, with every checked address (IPv4 first) to connect to."""
    target, addresses = await fetcher.check("https://Dual.Example./jobs/1?ref=a#top")
    assert target.host == "dual.example" and target.port == 443 and target.scheme == "https"
    assert addresses == ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"]
    assert str(target.url) == "https://dual.example./jobs/1?ref=a"
    assert target.host_header == b"dual.example"


async def test_public_ip_literal_needs_no_lookup(fetcher: PageFetcher, resolver: Resolver) -> None:
    """A public address in the URL is used as it is, without DNS."""
    target, addresses = await fetcher.check("http://93.184.216.34/job")
    assert addresses == ["93.184.216.34"] and resolver.calls == []
    assert target.host_header == b"93.184.216.34"


async def test_unresolvable_name_is_refused(fetcher: PageFetcher) -> None:
    """A name that does not resolve is unresolvable_host."""
    assert (await refused(fetcher, "http://nowhere.example/")).reason == "unresolvable_host"


@pytest.mark.parametrize("url", ["http://jobs.example:8080/", "https://jobs.example:22/",
                                 "http://93.184.216.34:6379/"])
async def test_ports_other_than_80_and_443_are_refused(
        fetcher: PageFetcher, resolver: Resolver, url: str) -> None:
    """Only ports 80 and 443 are fetched; a name on another port is never looked up."""
    assert (await refused(fetcher, url)).reason == "port_not_allowed"
    assert resolver.calls == []


async def test_port_443_over_http_and_80_over_https_are_allowed(fetcher: PageFetcher) -> None:
    """Either allowed port works with either scheme."""
    target, _ = await fetcher.check("http://jobs.example:443/")
    assert target.port == 443 and target.host_header == b"jobs.example:443"
    target, _ = await fetcher.check("https://jobs.example:80/")
    assert target.port == 80


@pytest.mark.parametrize("ip", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111",
                                "2a00:1450:4001:82b::200e"])
def test_public_addresses_are_public(ip: str) -> None:
    """Ordinary public unicast addresses pass the address check."""
    assert is_public_address(ipaddress.ip_address(ip))


def test_numeric_host_forms_are_read_like_browsers() -> None:
    """Decimal, hex, octal and short forms of an IPv4 host become the dotted address."""
    for host in ("1572395042", "0x5db8d822", "013556154042", "93.0xb8.55330"):
        assert check_url(f"http://{host}/").host == "93.184.216.34"


def test_default_policy_refuses_loopback() -> None:
    """With no settings, loopback is not allowed."""
    policy = FetchPolicy.from_env({})
    assert policy.allow_private == ()
    assert not policy.address_allowed(ipaddress.ip_address("127.0.0.1"))


@pytest.mark.parametrize("env", [{}, {"ATTO_ENV": "prod"}, {"ATTO_ENV": "dev"},
                                 {"ATTO_ENV": "localhost"}])
def test_allowlist_is_ignored_outside_local_mode(env: dict[str, str]) -> None:
    """PAGES_ALLOW_PRIVATE_HOSTS does nothing unless ATTO_ENV=local."""
    policy = FetchPolicy.from_env({**env, ENV_ALLOW_PRIVATE: "127.0.0.1,10.0.0.0/8"})
    assert policy.allow_private == ()
    assert not policy.address_allowed(ipaddress.ip_address("127.0.0.1"))


async def test_allowlist_in_local_mode_allows_listed_addresses_on_any_port() -> None:
    """In local mode the listed networks are fetched, on any port; others stay refused."""
    env = {"ATTO_ENV": "local", ENV_ALLOW_PRIVATE: "127.0.0.1, ::1"}
    fetcher = PageFetcher(env=env, resolver=Resolver())
    _, addresses = await fetcher.check("http://127.0.0.1:8765/pages/job/x")
    assert addresses == ["127.0.0.1"]
    for url in ("http://10.0.0.1/", "http://169.254.169.254/", "http://127.0.0.2/"):
        assert (await refused(fetcher, url)).reason == "private_address"
    assert (await refused(fetcher, "http://93.184.216.34:8765/")).reason == "port_not_allowed"


def test_malformed_allowlist_names_the_variable() -> None:
    """A bad allowlist entry fails loudly with the variable's name."""
    with pytest.raises(InvalidArgument, match=ENV_ALLOW_PRIVATE):
        FetchPolicy.from_env({"ATTO_ENV": "local", ENV_ALLOW_PRIVATE: "127.0.0.1,not-an-ip"})


def test_refusal_renders_the_public_error_shape() -> None:
    """A refusal is a 400 invalid_request body with message and reason."""
    with pytest.raises(PageRefused) as info:
        check_url("gopher://example.com/")
    response: Any = info.value.response()
    assert response.status_code == 400
    import json

    body = json.loads(response.body)
    assert body["error"]["code"] == "invalid_request"
    assert body["error"]["reason"] == "unsupported_scheme"
    assert body["error"]["message"]
