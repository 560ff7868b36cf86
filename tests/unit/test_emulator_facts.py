"""The emulator reads the facts a prompt states and answers with them, validly and the same
way every time."""

from __future__ import annotations

from typing import Any

import pytest

from local.emulator.facts import Salary, market_sentences, read_facts
from local.emulator.schema_instances import generate_instance, is_valid

LISTING = ("Extract the job listing.\n<<<PAGE\nData Engineer\n\nAcme Ltd, Berlin (hybrid). "
           "EUR 70,000 - 85,000 a year. Python, SQL.\nPAGE>>>")


@pytest.mark.parametrize(("text", "salary"), [
    ("EUR 70,000 - 85,000 a year", Salary(70000, 85000, "EUR", "year")),
    ("£45k–£55k per annum", Salary(45000, 55000, "GBP", "year")),
    ("30 - 40 EUR an hour", Salary(30, 40, "EUR", "hour")),
    ("paying USD 120,000", Salary(120000, None, "USD", "year")),
    ("€500 a day", Salary(500, None, "EUR", "day")),
    ("CHF 9.500 per month", Salary(9500, None, "CHF", "month")),
])
def test_salaries_are_read_as_written(text: str, salary: Salary) -> None:
    """Amounts, ranges, k suffixes, currency codes and signs, and periods are read as stated."""
    assert read_facts(f"<<<PAGE\nBackend Developer\n{text}.\nPAGE>>>").salary == salary


def test_listing_facts_come_from_the_page_not_the_instructions() -> None:
    """Title, company, place, skills and work mode come from the page block only."""
    facts = read_facts("remote: true only when the page offers remote work; answer in "
                       "English.\n" + LISTING)
    assert (facts.title, facts.company, facts.location) == ("Data Engineer", "Acme Ltd",
                                                            "Berlin")
    assert facts.skills == ("Python", "SQL") and facts.work_mode == "hybrid"
    assert facts.employment_type is None


def test_numbered_sources_are_read_with_their_numbers() -> None:
    """Each ``[n] title / URL: / text`` block is one source, numbered as given."""
    facts = read_facts("Brief:\n\n[1] One\nURL: https://a.example/1\nFirst text. More.\n\n"
                       "[2] Two\nURL: https://b.example/2\nSecond text.\n")
    assert [(s.number, s.title, s.url) for s in facts.sources] == [
        (1, "One", "https://a.example/1"), (2, "Two", "https://b.example/2")]
    assert facts.sources[0].text == "First text. More."


def test_market_sentences_use_only_the_figures_given() -> None:
    """Without a mean or a trend the sentences say so instead of inventing figures."""
    sentences = market_sentences({"role": "nurse", "place": "Leeds (GB)", "currency": "GBP",
                                  "open_positions": 12, "mean_advertised_salary": None,
                                  "monthly_mean_salary_oldest_first": []})
    assert sentences[0] == "There are 12 open nurse positions in Leeds (GB) right now."
    assert "no mean" in sentences[1] and "not enough salary history" in sentences[2]


LISTING_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "company", "location", "salary", "remote", "skills", "summary"],
    "properties": {
        "title": {"type": "string"}, "company": {"type": ["string", "null"]},
        "location": {"type": ["string", "null"]},
        "salary": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["min", "max", "currency", "period"],
            "properties": {"min": {"type": ["number", "null"]},
                           "max": {"type": ["number", "null"]},
                           "currency": {"type": ["string", "null"], "pattern": "^[A-Z]{3}$"},
                           "period": {"enum": ["hour", "year", None]}}}]},
        "remote": {"type": ["boolean", "null"]},
        "skills": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string", "maxLength": 300},
    },
}


def test_a_listing_schema_is_answered_with_the_listing() -> None:
    """A caller's own listing schema gets the pasted facts, and a summary built of them."""
    value = generate_instance(LISTING_SCHEMA, seed="s", hint=LISTING)
    assert is_valid(value, LISTING_SCHEMA)
    assert value["title"] == "Data Engineer" and value["location"] == "Berlin"
    assert value["salary"] == {"min": 70000, "max": 85000, "currency": "EUR", "period": "year"}
    assert value["skills"] == ["Python", "SQL"] and value["remote"] is True
    assert "EUR 70,000" in value["summary"]
    assert generate_instance(LISTING_SCHEMA, seed="s", hint=LISTING) == value


def test_facts_that_do_not_fit_the_schema_give_way_to_a_valid_answer() -> None:
    """When a stated fact breaks the schema (a lower-case code, a 3-letter title, an enum
    without it), the answer is still valid for the schema."""
    schema: dict[str, Any] = {
        "type": "object", "required": ["title", "currency", "employment_type"],
        "properties": {"title": {"type": "string", "maxLength": 3, "minLength": 3},
                       "currency": {"type": "string", "pattern": "^[a-z]{3}$"},
                       "employment_type": {"enum": ["seasonal"]}}}
    value = generate_instance(schema, seed=1, hint=LISTING)
    assert is_valid(value, schema)


def test_a_prompt_without_facts_answers_as_before() -> None:
    """A prompt stating no listing, sources or figures keeps the name-driven answers."""
    schema = {"type": "object", "properties": {"title": {"type": "string"}},
              "required": ["title"]}
    assert read_facts("Summarise: senior Python engineer, Berlin").known is False
    assert generate_instance(schema, seed=0, hint="Summarise: senior Python engineer, "
                                                  "Berlin") == {"title": "Senior Python Engineer"}


SOURCES_PROMPT = ("Write a brief about Acme.\n\n[1] Acme: overview\nURL: https://a.example/1\n"
                  "Acme was founded in 2009 and is headquartered in Leeds. More.\n\n"
                  "[2] Acme: news\nURL: https://b.example/2\nAcme raised GBP 20 million.\n")
FIGURES_PROMPT = ('Write 2 to 4 sentences.\n{"role": "nurse", "place": "Leeds (GB)", '
                  '"currency": "GBP", "open_positions": 310, "mean_advertised_salary": 31000.0, '
                  '"monthly_mean_salary_oldest_first": [["2026-01", 30500.0], '
                  '["2026-06", 31200.0]], "salary_change_pct_over_period": 2.3}')


@pytest.mark.parametrize("hint", [LISTING, SOURCES_PROMPT, FIGURES_PROMPT])
def test_every_test_schema_stays_valid_with_facts_in_the_prompt(hint: str) -> None:
    """Every schema of the generator's test set, and 200 random ones, still get valid
    instances when the prompt states a listing, numbered sources or market figures."""
    import random

    from tests.unit.test_emulator_schema import SCHEMAS, _random_schema

    schemas = [*SCHEMAS.values(), *(_random_schema(random.Random(k)) for k in range(200))]
    bad = [schema for schema in schemas
           if not is_valid(generate_instance(schema, seed=7, hint=hint), schema)]
    assert bad == []
