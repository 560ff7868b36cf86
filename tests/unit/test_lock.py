"""constraints.txt: the pinned development environment that `make venv` installs.

`make lock` writes it from a fresh resolve of pyproject.toml's dependencies and dev extra
(and client/pyproject.toml's), with the deps layer's pins as constraints; these tests keep
the files in step.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints.txt"
LAYER = ROOT / "layers" / "deps" / "requirements.txt"
FIX = "run `make lock` (then `make venv`)"


def _name(text: str) -> str:
    """A distribution name in its normal form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", text).lower()


def _pins(path: Path) -> dict[str, str]:
    """Every ``name==version`` line of a requirements file, by normalized name."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{path.name}: {line} is not a pin"
        assert not req.url and not req.marker, f"{path.name}: {line} is not a plain pin"
        pins[_name(req.name)] = specs[0].version
    return pins


def _declared() -> list[Requirement]:
    """pyproject.toml's dependencies and its dev extra, and the client's dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    return [Requirement(t) for t in [*project["dependencies"],
                                     *project["optional-dependencies"]["dev"],
                                     *client["dependencies"]]]


def test_lock_pins_every_declared_dependency_within_its_range() -> None:
    """Each dependency of the project (dev extra included) and the client is pinned, in range."""
    pins = _pins(LOCK)
    for req in _declared():
        name = _name(req.name)
        assert name in pins, f"{name} is not in constraints.txt: {FIX}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside {req.specifier}: {FIX}")


def test_lock_agrees_with_the_deps_layer() -> None:
    """Every package the deps layer ships is pinned to the same version for the tests."""
    lock, layer = _pins(LOCK), _pins(LAYER)
    differ = {name: (version, lock.get(name)) for name, version in layer.items()
              if lock.get(name) != version}
    assert differ == {}, f"layer pin vs constraints.txt: {differ}; {FIX}"


def test_running_environment_is_the_locked_one() -> None:
    """The installed version of every locked package is its pin (`make venv` used the lock)."""
    installed = {_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    differ = {name: (version, installed.get(name)) for name, version in _pins(LOCK).items()
              if installed.get(name) != version}
    assert differ == {}, f"pin vs installed: {differ}; run `make venv`"
