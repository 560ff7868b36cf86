"""Key naming: one hash tag per owner, and no input can escape it."""

from __future__ import annotations

import pytest

from usage_limits.keys import provider_keys, safe_name, user_keys


def test_user_keys_share_one_hash_tag() -> None:
    """Every key of a user carries the same {...} hash tag, so they share a cluster slot."""
    keys = user_keys("alice", "log", "ev", "meta")
    assert keys == ["ul:{u:alice}:log", "ul:{u:alice}:ev", "ul:{u:alice}:meta"]


@pytest.mark.parametrize("hostile", ["a}b", "a{b", "x:y", "line\nbreak", "a b", "x" * 129, "", "é"])
def test_unsafe_names_are_hashed(hostile: str) -> None:
    """Braces, colons, whitespace, non-ASCII, empty and very long ids are replaced by a digest."""
    name = safe_name(hostile)
    assert name.startswith("~") and len(name) == 65
    assert "{" not in name and "}" not in name and ":" not in name


def test_hashed_and_plain_names_never_collide() -> None:
    """A plain id can never equal the digest form of another id (``~`` is not a safe char)."""
    digest = safe_name("a}b")
    assert safe_name(digest) != digest


def test_provider_keys_are_tagged_per_provider() -> None:
    """Provider keys use their own tag namespace, distinct from users of the same name."""
    assert provider_keys("llm", "gcra") == ["ul:{p:llm}:gcra"]
    assert user_keys("llm", "gcra") != provider_keys("llm", "gcra")
