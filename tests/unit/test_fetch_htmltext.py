"""HTML to text for fetched pages: scripts and styles dropped, JSON-LD kept, JobPosting read."""

from __future__ import annotations

import json

from atto_providers.htmltext import html_to_text, job_postings, posting_fields

POSTING = {
    "@context": "https://schema.org/",
    "@type": "JobPosting",
    "title": "Senior Python Developer",
    "description": "<p>Build <b>APIs</b>.</p><p>Mentor the team.</p>",
    "employmentType": ["FULL_TIME", "CONTRACTOR"],
    "hiringOrganization": {"@type": "Organization", "name": "Acme Logistics"},
    "jobLocation": {"@type": "Place", "address": {
        "@type": "PostalAddress", "addressLocality": "Leeds", "addressRegion": "Yorkshire",
        "addressCountry": "GB"}},
    "jobLocationType": "TELECOMMUTE",
    "baseSalary": {"@type": "MonetaryAmount", "currency": "gbp", "value": {
        "@type": "QuantitativeValue", "minValue": 70000, "maxValue": "60,000",
        "unitText": "YEAR"}},
    "skills": "Python, SQL; AWS",
    "url": "https://jobs.example/1",
}

LD_GRAPH = json.dumps({"@graph": [{"@type": "Organization"}, POSTING]})
PAGE = f"""<!doctype html><html><head>
<title>Senior Python Developer &ndash; Acme</title>
<link rel="canonical" href="https://jobs.example/1">
<style>body {{ color: red }}</style>
<script>var secret = "do not show";</script>
<script type="application/ld+json">{LD_GRAPH}</script>
<script type="application/ld+json">{{ not json </script>
</head><body>
<noscript>Enable JavaScript</noscript>
<nav>Home</nav>
<h1>Senior   Python Developer</h1>
<p>Join   us &amp; build things.</p>
<ul><li>Python</li><li>SQL</li></ul>
<svg><text>chart label</text></svg>
<template><p>hidden template</p></template>
<p>Caf&eacute; on site<br>Leeds</p>
</body></html>"""


def test_visible_text_without_scripts_or_styles() -> None:
    """Scripts, styles, noscript, svg and templates are dropped; block elements make lines."""
    page = html_to_text(PAGE)
    assert "do not show" not in page.text and "color: red" not in page.text
    assert "Enable JavaScript" not in page.text and "chart label" not in page.text
    assert "hidden template" not in page.text
    assert "Senior Python Developer" in page.text
    assert "Join us & build things." in page.text
    assert "- Python\n- SQL" in page.text
    assert "Café on site\nLeeds" in page.text
    assert page.title == "Senior Python Developer – Acme"
    assert page.canonical_url == "https://jobs.example/1"


def test_json_ld_is_kept_and_bad_blocks_skipped() -> None:
    """JSON-LD blocks are parsed; a block that is not JSON is skipped."""
    page = html_to_text(PAGE)
    assert len(page.json_ld) == 1
    postings = job_postings(page.json_ld)
    assert [p["title"] for p in postings] == ["Senior Python Developer"]


def test_posting_fields_map_schema_org_to_listing_fields() -> None:
    """A JobPosting's title, company, place, salary, type, remote and skills are mapped."""
    fields = posting_fields(POSTING)
    assert fields["title"] == "Senior Python Developer"
    assert fields["company"] == "Acme Logistics"
    assert fields["location"] == "Leeds, Yorkshire, GB"
    assert fields["employment_type"] == "full_time"
    assert fields["remote"] is True
    assert fields["salary"] == {"min": 60000.0, "max": 70000.0, "currency": "GBP",
                                "period": "year"}
    assert fields["skills"] == ["Python", "SQL", "AWS"]
    assert fields["description"] == "Build APIs.\n\nMentor the team."
    assert fields["url"] == "https://jobs.example/1"


def test_posting_fields_leave_out_what_the_posting_does_not_state() -> None:
    """Absent or malformed values are left out, never guessed."""
    fields = posting_fields({"@type": "JobPosting", "title": "Nurse",
                             "baseSalary": {"value": {"value": "n/a"}},
                             "employmentType": "SOMETIMES"})
    assert fields == {"title": "Nurse"}


def test_type_lists_and_urls_are_recognised() -> None:
    """@type may be a list or a full schema.org URL."""
    blocks = ([{"@type": ["Thing", "https://schema.org/JobPosting"], "title": "A"}],
              {"@type": "WebPage"})
    assert [p["title"] for p in job_postings(blocks)] == ["A"]


def test_text_is_capped() -> None:
    """The text is cut at max_chars on a word boundary and marked truncated."""
    page = html_to_text("<p>" + "word " * 5000 + "</p>", max_chars=1000)
    assert page.truncated and len(page.text) <= 1000 and page.text.endswith("word")


def test_unclosed_and_broken_markup_never_raises() -> None:
    """Broken markup still gives the text it has."""
    page = html_to_text("<div><p>Open <b>bold <script>x</div> never closed")
    assert page.text.startswith("Open bold")
