"""Plans: ATTO_PLANS parsing, the default, and the order in which a user's plan is chosen."""

from __future__ import annotations

import pytest

from usage_limits.entitlements import Plans, claim_names
from usage_limits.exceptions import InvalidArgument
from usage_limits.web.settings import WebSettings

PLANS = "free=100/1h,1000/30d;pro=400/1h,20000/30d"


def test_atto_plans_defines_named_plans_and_the_default() -> None:
    """ATTO_PLANS and ATTO_DEFAULT_PLAN give each plan its windows and pick the default."""
    conf = WebSettings.from_env({"ATTO_PLANS": PLANS, "ATTO_DEFAULT_PLAN": "pro"})
    assert list(conf.plans.by_name) == ["free", "pro"]
    assert conf.plans.by_name["free"].windows == ((100, 3600), (1000, 30 * 86400))
    assert conf.plans.default == "pro"
    assert conf.plan == ((400, 3600), (20000, 30 * 86400))
    assert conf.plans.longest_s == 30 * 86400


def test_first_plan_is_the_default_when_none_is_named() -> None:
    """Without ATTO_DEFAULT_PLAN the first plan written is the default."""
    assert WebSettings.from_env({"ATTO_PLANS": PLANS}).plans.default == "free"


def test_atto_budget_alone_is_the_plan_named_default() -> None:
    """With ATTO_PLANS unset (or empty, as SAM passes it), ATTO_BUDGET is the one plan."""
    for env in ({"ATTO_BUDGET": "5/1m"}, {"ATTO_BUDGET": "5/1m", "ATTO_PLANS": ""}):
        plans = WebSettings.from_env(env).plans
        assert list(plans.by_name) == ["default"]
        assert plans.default_plan.windows == ((5, 60),)


@pytest.mark.parametrize("env", [
    {"ATTO_PLANS": "free"},
    {"ATTO_PLANS": "free=100/1h;free=200/1h"},
    {"ATTO_PLANS": "free=100/1x"},
    {"ATTO_PLANS": "fr ee=100/1h"},
    {"ATTO_PLANS": PLANS, "ATTO_DEFAULT_PLAN": "gold"},
    {"ATTO_DEFAULT_PLAN": "gold"},
    {"ATTO_PLANS": " ; "},
    {"ATTO_PLANS": "free=100/1h,weight=0"},
    {"ATTO_PLANS": "free=100/1h,weight=two"},
    {"ATTO_PLANS": "free=100/1h,share=2"},
])
def test_malformed_plans_are_rejected_with_the_setting_named(env: dict[str, str]) -> None:
    """A malformed plan list or an unknown default fails when settings are read, naming the
    variable."""
    with pytest.raises(InvalidArgument, match="ATTO_PLANS|ATTO_DEFAULT_PLAN"):
        WebSettings.from_env(env)


def test_a_plan_may_carry_a_fair_share_weight() -> None:
    """``weight=N`` among a plan's windows sets its users' share of a saturated provider;
    a plan without it weighs 1, and its windows are read as before."""
    plans = Plans.parse("free=100/1h,1000/30d;pro=400/1h,weight=2.5,20000/30d")
    assert (plans.by_name["free"].weight, plans.by_name["pro"].weight) == (1.0, 2.5)
    assert plans.by_name["pro"].windows == ((400, 3600), (20000, 2592000))
    assert plans.by_name["free"].windows == ((100, 3600), (1000, 2592000))


def test_resolution_order_is_override_then_claim_then_default() -> None:
    """The override beats the claim, the claim beats the default."""
    plans = Plans.parse(PLANS)
    overridden = plans.resolve(override="pro", claim="free")
    assert (overridden.plan.name, overridden.source) == ("pro", "override")
    claimed = plans.resolve(claim="pro")
    assert (claimed.plan.name, claimed.source) == ("pro", "claim")
    default = plans.resolve()
    assert (default.plan.name, default.source, default.unknown_claim) == ("free", "default", None)


def test_an_override_naming_a_removed_plan_is_skipped() -> None:
    """An override for a plan the deployment no longer has falls through to the claim."""
    resolved = Plans.parse(PLANS).resolve(override="gold", claim="pro")
    assert (resolved.plan.name, resolved.source) == ("pro", "claim")


def test_unknown_claim_falls_back_to_the_default_and_is_reported() -> None:
    """A claim naming no plan gets the default plan, and the unknown value is reported."""
    resolved = Plans.parse(PLANS).resolve(claim="platinum")
    assert (resolved.plan.name, resolved.source, resolved.unknown_claim) == \
        ("free", "default", "platinum")


@pytest.mark.parametrize("claim, expected", [
    ("[admins pro free]", "pro"),      # API Gateway's flattened cognito:groups
    (["admins", "free", "pro"], "free"),
    ("admins,pro", "pro"),
    ("pro", "pro"),
])
def test_the_first_group_naming_a_plan_wins(claim: object, expected: str) -> None:
    """In a list-valued claim (cognito:groups) the first name that is a plan wins."""
    assert Plans.parse(PLANS).resolve(claim=claim).plan.name == expected


def test_claim_names_reads_every_shape() -> None:
    """Strings, flattened lists and lists all give their names in order; None gives none."""
    assert claim_names(None) == []
    assert claim_names("[a b]") == ["a", "b"]
    assert claim_names(["a", " b "]) == ["a", "b"]
    assert claim_names(7) == ["7"]


def test_resolutions_repeated_per_request_give_the_same_answers() -> None:
    """Resolving the same claim again (as every request does) gives the first answer, an
    unknown claim still reported, and the override still wins over a claim seen before."""
    plans = Plans.parse(PLANS)
    for _ in range(3):
        assert plans.resolve(claim="pro") == plans.resolve(claim="pro")
        assert (plans.resolve().plan.name, plans.resolve().source) == ("free", "default")
        assert plans.resolve(claim="platinum").unknown_claim == "platinum"
        assert plans.resolve(override="free", claim="pro").source == "override"
        assert plans.resolve(claim=["pro"]).plan.name == "pro"


def test_many_distinct_claims_all_resolve() -> None:
    """Past the claims a Plans keeps, every claim is still resolved by its own value."""
    from usage_limits.entitlements.plans import MAX_KEPT_CLAIMS

    plans = Plans.parse(PLANS)
    for i in range(MAX_KEPT_CLAIMS + 10):
        resolved = plans.resolve(claim=f"[group{i} pro]" if i % 2 else f"group{i}")
        assert resolved.plan.name == ("pro" if i % 2 else "free")
        assert resolved.unknown_claim == (None if i % 2 else f"group{i}")
