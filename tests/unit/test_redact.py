"""The provider-text scrubber (ballet_common/redact.py): credentials never survive, text
stays readable, and the result is one short line."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ballet_common.redact import MAX_CHARS, REDACTED, redact, scrub

KEY = "sk-proj-Zq8dX3vL0pR7wT2yN5bC1mK9"


@pytest.mark.parametrize(
    "text",
    [
        f"Incorrect API key provided: {KEY}. You can find your API key at the dashboard.",
        f'{{"error": {{"message": "bad", "api_key": "{KEY}"}}}}',
        f"Authorization: Bearer {KEY}\r\nHost: example",
        f"authorization={KEY}",
        f"GET /v1/models?api_key={KEY}&x=1",
        f"proxy said: Proxy-Authorization: Basic {KEY}",
        f"x-api-key: {KEY}",
        f"'access_token': '{KEY}'",
        f"client_secret={KEY}",
        f"the bearer {KEY} was refused",
        f"{'x' * 200} {KEY}",
    ],
)
def test_a_planted_key_never_survives(text: str) -> None:
    cleaned = scrub(text)
    assert KEY not in cleaned
    assert "Zq8dX3vL0pR7" not in cleaned
    assert REDACTED in cleaned or len(cleaned) <= MAX_CHARS


@pytest.mark.parametrize(
    "secret",
    [
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
        "xoxb-1234567890-abcdefghij",
        "AIzaSyA-abcdefghijklmnopqrstuvwxyz012345",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXBhcnQ",
    ],
)
def test_well_known_key_shapes_are_redacted(secret: str) -> None:
    assert secret not in redact(f"refused {secret} here")


def test_ordinary_error_text_is_kept() -> None:
    text = "This model's maximum context length is 8192 tokens; max_tokens=100 exceeds it."
    assert scrub(text) == text


def test_the_result_is_one_cut_line() -> None:
    text = "line one\n\n  line two\t" + "y" * 1000
    cleaned = scrub(text, max_chars=40)
    assert "\n" not in cleaned and len(cleaned) == 40 and cleaned.endswith("…")
    assert cleaned.startswith("line one line two y")


def test_a_huge_body_is_cut_without_reading_it_all() -> None:
    cleaned = scrub("<html>" + "z" * 10_000_000)
    assert len(cleaned) == MAX_CHARS and cleaned.endswith("…")


def test_max_chars_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        scrub("x", max_chars=0)


@given(
    prefix=st.text(max_size=400),
    suffix=st.text(max_size=400),
    body=st.text(alphabet=string.ascii_letters + string.digits, min_size=20, max_size=60),
)
def test_no_sk_key_survives_any_surrounding_text(prefix: str, suffix: str, body: str) -> None:
    secret = f"sk-{body}"
    cleaned = scrub(f"{prefix} {secret} {suffix}", max_chars=2000)
    assert secret not in cleaned
