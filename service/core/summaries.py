"""Whether a compaction answer may become the session's summary (docs/spec/compaction.md: "a summary
is accepted only if its call finished normally ... and the text is not a refusal, an error
or implausibly short"; decision 0170).

A summary replaces the conversation it covers in the model's context for good, so a bad
one loses the session's history: a refusal ("I'm sorry, but I can't help with that
request."), a gateway or provider error passed through as text, or a few words standing
for thousands of tokens. ``check_summary`` rejects, in this order:

1. a call that did not finish normally: only ``STOP`` (and ``UNSPECIFIED``, an old
   gateway's) is accepted; ``REFUSAL``, ``LENGTH`` (a summary cut off mid-way),
   ``CONTENT_FILTER`` and ``TOOL_CALLS`` (no tools are offered) are not. A stream that
   ended with no finish at all is already a ``ModelFailure``;
2. an empty text;
3. a refusal or apology: the text opens with one (English, German, French, Spanish,
   Chinese, Japanese), or a short text (under ``SHORT_TEXT_CHARS``) says it cannot help
   anywhere in it. A summary is written about the conversation, so a first-person
   apology at its start is the summarizer declining, not a summary;
4. error text: a text opening like an error report (``Error:``, ``ValueError:``,
   ``Traceback``, ``Internal Server Error``, ``HTTP 503``...), or a JSON object that is
   an error (``error`` or ``errors`` at its top, or only ``detail``/``message``/``code``/
   ``status``-like keys);
5. an implausibly short text: fewer tokens (``service/core/estimate.py``) than
   ``SHORT_SHARE`` of the tokens it replaces (the earlier summary and the messages it
   folds in), with that floor capped at ``SHORT_CAP_TOKENS``. Replacing 1,000 tokens
   takes at least 10; replacing 3,200 or more takes at least 32 (about 25 English words,
   or 30 Chinese characters): lenient for a terse summarizer, but "OK.", "Done." or a
   bare heading standing for a long history is rejected;
6. an echo of the request (decision 0294): the text holds the request's own framing, a
   data tag (``<earlier_summary>``, ``<conversation>``, opening or closing) or a
   sentence of the request's instructions (``framing``: the request line "Write the
   updated summary now ...", the material note, the summary instructions' lines of at
   least ``ECHO_MIN_CHARS``), whitespace and case aside;
7. a copy (``verbatim``): more than ``VERBATIM_SHARE`` of the text's runs of
   ``VERBATIM_WORDS`` words appear word for word in the conversation it summarizes
   (``source``; the earlier summary is not counted: an update keeps much of it);
8. a text not shorter than what it replaces (``not_shorter``): over
   ``NOT_SHORTER_FLOOR_TOKENS`` tokens and at least ``replaced_tokens`` (a summary that
   saves nothing is not one; a few sentences for a short exchange are let through).

A rejection's ``reason`` is a bounded label for the failure counter; nothing here logs or
returns the text itself (docs/spec/operations.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.core.estimate import text_tokens
from service.core.ports.model import FinishReason

#: Finishes after which an answer is whole.
NORMAL_FINISHES = frozenset({FinishReason.STOP, FinishReason.UNSPECIFIED})
#: A summary must be at least this share of the tokens it replaces...
SHORT_SHARE = 0.01
#: ...but never needs more than this many tokens to be plausible.
SHORT_CAP_TOKENS = 32
#: A text this short is checked for a refusal anywhere in it, not only at its start.
SHORT_TEXT_CHARS = 400
#: How much of a text's start is read for an opening refusal or error.
_OPENING_CHARS = 200
#: A line of the request's instructions this long, found in a summary, is an echo.
ECHO_MIN_CHARS = 40
#: A summary whose runs of ``VERBATIM_WORDS`` words come from its input for more than
#: this share of them copies its input.
VERBATIM_SHARE = 0.5
VERBATIM_WORDS = 8
#: A summary of at most this many tokens is never refused for its length.
NOT_SHORTER_FLOOR_TOKENS = 64
_DATA_TAGS = re.compile(r"</?\s*(?:earlier_summary|conversation)\s*>", re.IGNORECASE)
_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\w+")

_REFUSAL_OPENINGS = re.compile(
    r"""^(?:
        # English
        (?:i'?m|i\ am)\ (?:so\ |very\ |really\ |truly\ )?sorry
        | (?:i'?m|i\ am)\ (?:unable|not\ able|afraid\ i)\b
        | i\ (?:can'?t|cannot|can\ not|won'?t|will\ not|must\ decline|have\ to\ decline
              |do\ not\ feel\ comfortable)\b
        | sorry\b | my\ apologies | apologies\b | i\ (?:sincerely\ )?apologi[sz]e
        | unfortunately,?\ i\b | as\ an\ ai\b
        # German
        | (?:es\ )?tut\ mir\ (?:sehr\ )?leid | entschuldigung | leider\ kann\ ich
        | ich\ kann\ (?:ihnen\ |dir\ )?(?:dabei\ |damit\ |hierbei\ )?nicht
        # French
        | je\ suis\ (?:vraiment\ )?d[ée]sol[ée] | d[ée]sol[ée] | je\ m'excuse
        | je\ ne\ (?:peux|suis)\ pas | malheureusement,?\ je\ ne
        # Spanish
        | lo\ (?:siento|lamento) | disculp[ae] | perd[oó]n | lamentablemente,?\ no\ puedo
        | no\ puedo\ (?:ayudar|hacer|cumplir|proporcionar)
        # Chinese
        | (?:非常|很|十分)?抱歉 | 对不起 | 不好意思 | 我(?:无法|不能|没办法)
        # Japanese
        | 申し訳 | すみません | ごめんなさい | 恐れ入りますが | 残念ながら
    )""",
    re.IGNORECASE | re.VERBOSE,
)
_REFUSAL_ANYWHERE = re.compile(
    r"""(?:
        (?:can'?t|cannot|can\ not|unable\ to|not\ able\ to|won'?t)
            \ (?:help|assist|comply|fulfil|fulfill|provide|summari[sz]e|do\ that|continue)
        | kann\ (?:ich\ )?(?:ihnen\ |dir\ )?(?:dabei\ |damit\ )?nicht\ helfen
        | ne\ (?:peux|pourrai)\ pas\ (?:vous\ |t')?aider
        | no\ (?:puedo|podr[eé])\ ayudar
        | 无法(?:协助|帮助|提供|完成|总结) | 不能(?:协助|帮助|提供)
        | お手伝いできません | お応えできません | 対応できません | できかねます
    )""",
    re.IGNORECASE | re.VERBOSE,
)
_ERROR_OPENINGS = re.compile(
    r"""^(?:
        [a-z_.]*(?:error|exception)\s*(?::|\s-\s|\(|\[|\d) | \[error\] | error\ code\b
        | fatal(?:\ error)?: | traceback\ \(most\ recent\ call
        | an?\ (?:unexpected\ |internal\ |unknown\ )?error\ (?:has\ )?occurred
        | internal\ server\ error | bad\ gateway | service\ unavailable | gateway\ time-?out
        | request\ failed | http\ (?:error\ )?[45]\d\d\b | status\ code:?\ [45]\d\d\b
        | (?:[45]\d\d\ )?(?:too\ many\ requests|rate\ limit\ (?:exceeded|reached))
        | the\ server\ had\ an\ error
    )""",
    re.IGNORECASE | re.VERBOSE,
)
_ERROR_ONLY_KEYS = frozenset(
    {"detail", "message", "code", "status", "statusCode", "type", "param", "request_id"}
)
_FENCE = re.compile(r"^```[a-zA-Z]*\s*(.*?)\s*```$", re.DOTALL)
# Markdown and quoting a refusal may come wrapped in, removed before it is read.
_LEADING_NOISE = re.compile("^[\\s>#*_\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb\u300c\u300d-]+")
#: Curly apostrophes, read as straight ones (``I\u2019m sorry``).
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'"})


@dataclass(frozen=True)
class Rejection:
    """Why a summary was rejected: ``reason`` is a bounded label (``finish_<reason>``,
    ``empty``, ``refusal``, ``error``, ``too_short``, ``echo``, ``verbatim``,
    ``not_shorter``, or ``model`` for a failed call and ``budget`` for one the turn's
    budget could not pay), ``detail`` a phrase for the log. Neither holds any of the
    text."""

    reason: str
    detail: str


def check_summary(
    text: str,
    finish: FinishReason | None,
    *,
    replaced_tokens: int,
    framing: Sequence[str] = (),
    source: str = "",
) -> Rejection | None:
    """None when ``text`` may replace ``replaced_tokens`` tokens of context, else why not
    (see the module docstring for the rules and their order). ``framing`` is the
    request's own text (its instructions and request line), ``source`` the conversation
    it summarizes."""
    if finish is not None and finish not in NORMAL_FINISHES:
        return Rejection(f"finish_{finish.value}", f"the call finished with {finish.value}")
    stripped = text.strip()
    if not stripped:
        return Rejection("empty", "the summary is empty")
    opening = _LEADING_NOISE.sub("", stripped[: _OPENING_CHARS * 2]).translate(_APOSTROPHES)
    opening = opening[:_OPENING_CHARS]
    if _REFUSAL_OPENINGS.match(opening) or (
        len(stripped) < SHORT_TEXT_CHARS
        and _REFUSAL_ANYWHERE.search(stripped.translate(_APOSTROPHES))
    ):
        return Rejection("refusal", "the summary reads as a refusal or an apology")
    if _ERROR_OPENINGS.match(opening) or _is_json_error(stripped):
        return Rejection("error", "the summary reads as an error report")
    needed = min(SHORT_CAP_TOKENS, int(replaced_tokens * SHORT_SHARE))
    tokens = text_tokens(stripped)
    if tokens < needed:
        return Rejection(
            "too_short",
            f"the summary is {tokens} tokens for {replaced_tokens}; at least {needed} expected",
        )
    return _echo(stripped, framing) or _copy(stripped, source, tokens, replaced_tokens)


def _echo(text: str, framing: Sequence[str]) -> Rejection | None:
    if _DATA_TAGS.search(text):
        return Rejection("echo", "the summary repeats the request's data tags")
    flat = _flat(text)
    for part in framing:
        for line in part.splitlines():
            line = _flat(line)
            if len(line) >= ECHO_MIN_CHARS and line in flat:
                return Rejection("echo", "the summary repeats the request's instructions")
    return None


def _copy(text: str, source: str, tokens: int, replaced_tokens: int) -> Rejection | None:
    if source:
        runs = _runs(text)
        if runs:
            copied = len(runs & _runs(source)) / len(runs)
            if copied > VERBATIM_SHARE:
                return Rejection(
                    "verbatim", f"{copied:.0%} of the summary is copied from its input"
                )
    if tokens > NOT_SHORTER_FLOOR_TOKENS and tokens >= replaced_tokens:
        return Rejection(
            "not_shorter",
            f"the summary is {tokens} tokens, not shorter than the {replaced_tokens} it replaces",
        )
    return None


def _flat(text: str) -> str:
    return _SPACE.sub(" ", text).strip().casefold()


def _runs(text: str) -> set[tuple[str, ...]]:
    """The text's runs of ``VERBATIM_WORDS`` words, case aside."""
    words = _WORD.findall(text.casefold())
    return {tuple(words[i : i + VERBATIM_WORDS]) for i in range(len(words) - VERBATIM_WORDS + 1)}


def _is_json_error(text: str) -> bool:
    fenced = _FENCE.match(text)
    if fenced is not None:
        text = fenced.group(1)
    if not text.startswith("{"):
        return False
    try:
        value: Any = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    if "error" in value or "errors" in value:
        return True
    return bool(value) and set(value) <= _ERROR_ONLY_KEYS
