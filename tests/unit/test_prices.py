"""Route costs are declared once per route; the price list and the README agree with them."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from local.template import functions

ROOT = Path(__file__).resolve().parents[2]


def declared_costs() -> dict[str, int]:
    """Cost of every metered route, read from the require_tokens dependency it declares."""
    costs: dict[str, int] = {}
    for fn in functions():
        app = importlib.import_module(fn.code_dir.replace("/", ".") + ".app").app
        for route in app.routes:
            methods = getattr(route, "methods", None)
            dependant = getattr(route, "dependant", None)
            if not methods or dependant is None:
                continue
            stack = list(dependant.dependencies)
            while stack:
                dep = stack.pop()
                if hasattr(dep.call, "cost"):
                    for method in methods:
                        costs[f"{method} {route.path}"] = dep.call.cost
                stack.extend(dep.dependencies)
    return costs


def test_price_list_matches_route_declarations() -> None:
    """GET /v1/usage's price list is every public template route: the declared cost, or 0 if
    free (the operator API is not for users and is not listed)."""
    prices = importlib.import_module("functions.usage.app").PRICES
    declared = declared_costs()
    assert prices == {fn.route_key: declared.get(fn.route_key, 0) for fn in functions()
                      if not fn.path.startswith("/admin/")}


def test_readme_route_table_is_the_price_list() -> None:
    """The README's route table shows exactly the price list's routes, each with its cost."""
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\|\s*`([A-Z]+ /v1/\S+)`\s*\|\s*([^|]*?)\s*\|", readme, re.M)
    prices = importlib.import_module("functions.usage.app").PRICES
    assert {route: int(cost) if cost.isdigit() else cost for route, cost in rows} == prices
    assert len(rows) == len(prices)


def test_every_function_but_usage_is_metered() -> None:
    """Every cloud feature costs tokens; only GET /v1/usage and GET /v1/usage/history (and
    the operator API, which no user reaches) are free."""
    metered = {route.split()[1] for route in declared_costs()}
    public = {fn.path for fn in functions() if not fn.path.startswith("/admin/")}
    assert public - metered == {"/v1/usage", "/v1/usage/history"}


def test_client_readme_route_table_is_the_price_list() -> None:
    """client/README.md's method table gives each route the price list's cost."""
    readme = (ROOT / "client" / "README.md").read_text()
    rows = re.findall(r"^\|\s*`[a-z_]+\(.*?\)`\s*\|\s*`([A-Z]+ /v1/\S+)`\s*\|\s*([^|]*?)\s*\|",
                      readme, re.M)
    prices = importlib.import_module("functions.usage.app").PRICES
    assert {route: int(cost) if cost.isdigit() else cost for route, cost in rows} == prices
