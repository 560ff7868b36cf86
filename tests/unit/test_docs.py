"""The README and docs/ stay linked and short, and name every setting the code reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from local.template import functions, load_template
from usage_limits import config
from usage_limits.web import idempotency, settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOCUMENTS = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

#: The reference topics, one file each, that the README links to.
TOPICS = ("api", "ledger", "throttle", "configuration", "emulator", "benchmarks",
          "reliability", "deployment", "development")

#: Provider names as they prefix their variables (``LLM_RATE``).
PROVIDERS = ("LLM", "SALARY", "SEARCH", "PAGES")

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Anchors of every heading outside code fences of one Markdown file."""
    anchors: set[str] = set()
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"#{1,6} (.+)", line)):
            anchors.add(_slug(match.group(1)))
    return anchors


def test_readme_is_short() -> None:
    """The README stays a five-minute read: under 300 lines."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 300


@pytest.mark.parametrize("topic", TOPICS)
def test_readme_links_every_topic(topic: str) -> None:
    """Each reference topic has its own file under docs/, linked from the README."""
    assert (DOCS / f"{topic}.md").is_file()
    assert f"](docs/{topic}.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    """Every relative link of a document names an existing file, and its anchor a heading."""
    broken = []
    for target in _LINK.findall(document.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        missing_anchor = path.exists() and anchor and path.suffix == ".md" \
            and anchor not in _anchors(path)
        if not path.exists() or missing_anchor:
            broken.append(target)
    assert broken == []


def _code_settings() -> set[str]:
    """Every environment variable name the layer declares as a constant."""
    names = {value for name, value in vars(config).items()
             if name.endswith("_ENV") and isinstance(value, str)}
    names |= {value for name, value in vars(settings).items()
              if name.startswith("ATTO_") and isinstance(value, str)}
    names.add(idempotency.IDEMPOTENCY_TTL_S)
    return names


def _template_settings() -> set[str]:
    """Every environment variable template.yaml gives a function (Globals included)."""
    template = load_template()
    names = set(template["Globals"]["Function"]["Environment"]["Variables"])
    for resource in template["Resources"].values():
        if resource.get("Type") == "AWS::Serverless::Function":
            env = resource.get("Properties", {}).get("Environment") or {}
            names |= set(env.get("Variables") or {})
    return names


def _documented(text: str) -> set[str]:
    """Variable names a document shows in backticks, ``<P>_RATE`` read as each provider's."""
    names = set(re.findall(r"`([A-Z][A-Z0-9_]*)`", text))
    for suffix in re.findall(r"`<P(?:ROVIDER)?>(_[A-Z0-9_]+)`", text):
        names |= {provider + suffix for provider in PROVIDERS}
    return names


def test_configuration_names_every_setting() -> None:
    """docs/configuration.md documents every variable the code declares and the template sets."""
    wanted = _code_settings() | _template_settings()
    documented = _documented((DOCS / "configuration.md").read_text(encoding="utf-8"))
    assert len(wanted) > 20  # both sources were read
    assert sorted(wanted - documented) == []


def test_deployment_routes_match_template() -> None:
    """docs/deployment.md's route table maps each template route to its function, no more."""
    text = (DOCS / "deployment.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"^\| `([A-Z]+ /\S+)` \| `(functions/\w+)` \|", text, re.M))
    assert shown == {(fn.route_key, fn.code_dir) for fn in functions()}
