"""The calibrated token estimator: how many tokens a text costs the model, without its
tokenizer (docs/spec/compaction.md, "about four characters per token when no usage is
known"; docs/spec/compaction.md, "calibrated by script"; decision 0171).

UTF-8 bytes / 4 is 18% over a cl100k count on English prose and 27-35% under on Chinese,
Japanese and Korean. The estimator counts by script class instead, each with its own
rate, calibrated against cl100k on samples written for it
(``tests/unit/token_samples/``, where ``README.md`` says how the reference counts were
made):

- **Latin text**: ASCII letters, ``RATE_ENGLISH`` tokens each (about 4.5 letters a
  token), or ``RATE_LATIN`` (about 3.5) when accented letters make up more than
  1/200 of a text's letters (French, German, Spanish...: their words are rarer in the
  tokenizer's vocabulary). Spaces and tabs are free: BPE joins a space to the word after
  it.
- **Code and JSON**: *pieces*, ``RATE_PIECE`` tokens each. A piece is a run of ASCII
  punctuation (``":"``, ``},{``, ``->``: BPE merges a run into about one token), three
  digits (cl100k splits numbers into groups of at most three), or a line break. The
  letters of identifiers and keys count as Latin text.
- **CJK**: Han characters, kana, CJK and full-width punctuation, ``RATE_CJK`` each (a
  little over one token a character); Hangul syllables, ``RATE_HANGUL`` each.
- **Other**: every other character (Cyrillic, Greek, Arabic, accented letters, emoji...),
  ``RATE_OTHER`` each (measured on Russian prose only).

On the samples the estimate is within 9% of cl100k for every class (within 3% for
English prose, JSON, Chinese and Japanese). Other tokenizers differ (o200k, Claude's,
Llama's): ``ballet_planner_context_estimate_ratio`` shows how far the estimate is from
what the provider reports, so a drift is seen, not guessed.

Non-ASCII characters are classed by their UTF-8 lead byte (see ``_LEADS``), so a text
costs O(its length) in a few C-level passes and no Python loop: 0.3 to 0.6 ms for a
16 KiB tool result on this project's 2-core machines. The context estimate adds each
message once, when it is stored (a running total), so it stays O(new messages).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from service.core.model import Message, MessageKind
from service.core.ports.model import ToolDeclaration

#: Tokens per ASCII letter of English text (calibrated: 0.2221).
RATE_ENGLISH = 0.222
#: Tokens per ASCII letter of other Latin-script languages (calibrated: 0.284).
RATE_LATIN = 0.284
#: Tokens per piece of code and JSON: a punctuation run, three digits, a line break
#: (calibrated: 0.9973).
RATE_PIECE = 1.0
#: Tokens per Han character, kana or CJK punctuation (calibrated: 1.0345).
RATE_CJK = 1.036
#: Tokens per Hangul syllable (calibrated: 1.2517, on one Korean sample).
RATE_HANGUL = 1.25
#: Tokens per other non-ASCII character (calibrated: 0.4797, on one Russian sample).
RATE_OTHER = 0.482
#: A text is "other Latin" when more than one letter in this many is accented.
_ACCENTED_SHARE = 200
#: The rates in the order of ``class_counts``.
RATES = (RATE_ENGLISH, RATE_LATIN, RATE_PIECE, RATE_CJK, RATE_HANGUL, RATE_OTHER)

#: Tokens every message costs beyond its content: the role and the separators of the
#: provider's chat format (OpenAI documents three to four per message).
MESSAGE_OVERHEAD_TOKENS = 4
#: Tokens a tool call or a result costs beyond its name and JSON: its id and structure
#: (a 37-character planner id alone is about 15 tokens).
TOOL_CALL_OVERHEAD_TOKENS = 20
#: Tokens each tool declaration costs beyond its name, description and schema.
DECLARATION_OVERHEAD_TOKENS = 8

# UTF-8 byte -> class, for the ASCII bytes: 1 letter, 2 punctuation, 4 digit, 8 line
# break, 0 the rest (spaces, controls, and every byte of a non-ASCII character).
_CLASSES = bytes(
    (
        1
        if chr(b).isalpha()
        else 4
        if chr(b).isdigit()
        else 8
        if b == 0x0A
        else 2
        if 0x21 <= b < 0x7F
        else 0
    )
    if b < 0x80
    else 0
    for b in range(256)
)
# UTF-8 byte -> 1 for ASCII punctuation, else 0 (runs are counted on these as one int).
_PUNCTUATION = bytes(1 if c == 2 else 0 for c in _CLASSES)
# A non-ASCII character's class, by its UTF-8 lead byte (continuation bytes are 0):
# 16 accented Latin (U+00C0..U+027F: leads C3..C9), 32 CJK (U+3000..U+9FFF: E3..E9;
# U+F000..U+FFFF, the compatibility and full-width forms: EF), 64 Hangul (U+A000..U+DFFF:
# EA..ED), 128 other (Greek, Cyrillic, Arabic, Indic, symbols, emoji...). The lead byte
# is a C-speed stand-in for a code point lookup; it misfiles only rare blocks (CJK
# radicals U+2E80.. as other, Yi U+A000.. as Hangul).
_LEADS = bytes(
    16
    if 0xC3 <= b <= 0xC9
    else 32
    if 0xE3 <= b <= 0xE9 or b == 0xEF
    else 64
    if 0xEA <= b <= 0xED
    else 128
    if b >= 0xC2
    else 0
    for b in range(256)
)


def text_tokens(text: str) -> int:
    """About how many cl100k tokens ``text`` is (see the module docstring); 0 for ""."""
    if not text:
        return 0
    counts = class_counts(text)
    total = sum(count * rate for count, rate in zip(counts, RATES, strict=True))
    return math.ceil(total)


def class_counts(text: str) -> tuple[float, float, float, float, float, float]:
    """What ``text`` holds of each class, in the order of ``RATES``: English letters,
    other Latin letters, code and JSON pieces, CJK characters, Hangul syllables, other
    characters (the calibration script fits the rates on these)."""
    data = text.encode()
    classes = data.translate(_CLASSES)
    letters = classes.count(b"\x01")
    # A run of punctuation is one piece: punctuation bytes minus those that follow one.
    marks = int.from_bytes(data.translate(_PUNCTUATION), "little")
    punctuation_runs = marks.bit_count() - (marks & (marks >> 8)).bit_count()
    pieces = punctuation_runs + classes.count(b"\x04") / 3 + classes.count(b"\x08")
    cjk = hangul = other = accented = 0
    if len(data) != len(text):
        leads = data.translate(_LEADS)
        accented, cjk, hangul = leads.count(b"\x10"), leads.count(b"\x20"), leads.count(b"\x40")
        other = leads.count(b"\x80") + accented
    foreign = accented * _ACCENTED_SHARE > letters + accented
    english, latin = (0, letters) if foreign else (letters, 0)
    return (english, latin, pieces, cjk, hangul, other)


def _message_tokens(message: Message) -> int:
    """About how many tokens ``message`` costs in a model request: its text, tool name,
    arguments and result, plus the overheads above. Compaction markers are not sent: 0.
    """
    if message.kind is MessageKind.COMPACTION:
        return 0
    tokens = MESSAGE_OVERHEAD_TOKENS + text_tokens(message.text)
    if message.kind in (MessageKind.TOOL_CALL, MessageKind.TOOL_RESULT):
        tokens += (
            TOOL_CALL_OVERHEAD_TOKENS
            + text_tokens(message.tool_name)
            + text_tokens(message.tool_arguments)
            + text_tokens(message.tool_result)
        )
    return tokens


def message_tokens(message: Message) -> int:
    """``_message_tokens(message)``, computed once per message object: the loop, the store
    and the context cache each count the messages of a commit, and a frozen message
    always counts the same (a numbered copy keeps it, as it keeps ``size_bytes``). Kept
    on the object rather than in a cache keyed by the message, whose every lookup hashed
    all its fields."""
    tokens: int | None = message.__dict__.get("_tokens")
    if tokens is None:
        tokens = _message_tokens(message)
        # Not a field: equality, repr and the store never see it.
        object.__setattr__(message, "_tokens", tokens)
    return tokens


def messages_tokens(messages: Iterable[Message]) -> int:
    """The sum of ``message_tokens`` over ``messages``."""
    return sum(message_tokens(message) for message in messages)


def declarations_tokens(declarations: Iterable[ToolDeclaration]) -> int:
    """About how many tokens the tool declarations cost: name, description and JSON
    Schema of each, plus ``DECLARATION_OVERHEAD_TOKENS``."""
    return sum(
        DECLARATION_OVERHEAD_TOKENS
        + text_tokens(d.name)
        + text_tokens(d.description)
        + text_tokens(d.parameters_json_schema)
        for d in declarations
    )


#: The most the calibration raises an estimate: a model's tokenizer and chat template
#: rarely take more than twice the cl100k count; a reading beyond it is a fault (a server
#: that rendered something else), not a tokenizer.
CALIBRATION_MAX = 2.0
#: The weight of a new reading in the learned factor (an exponential moving average).
CALIBRATION_WEIGHT = 0.3


@dataclass
class TokenCalibration:
    """The model's input tokens per estimated token, learned from reported usage
    (decision 0350).

    The estimator counts cl100k tokens; the model counts its own tokenizer's tokens and
    its chat template's (a template that renders the tool declarations as indented JSON
    adds a fifth to them). When no usage is known (a session's first request, the
    request after a compaction) the estimate is the raw count times ``factor``.
    ``observe`` takes each answer whose request was estimated without usage: the raw
    estimate and the input tokens the model reported. The first reading sets ``factor``,
    later ones move it by ``CALIBRATION_WEIGHT``; it stays within 1 and
    ``CALIBRATION_MAX``: an estimate is never lowered below the cl100k count (a low
    estimate overflows the window, a high one only compacts a little early), so a server
    that dropped the tools (decision 0297) or a tokenizer leaner than cl100k teaches
    nothing. One per planner process, which calls one configured model; not stored.
    """

    factor: float = 1.0
    readings: int = 0

    def observe(self, estimated: int, reported: int) -> None:
        """A request estimated at ``estimated`` raw tokens was reported as ``reported``
        input tokens; both > 0, else ignored."""
        if estimated <= 0 or reported <= 0:
            return
        ratio = min(CALIBRATION_MAX, max(1.0, reported / estimated))
        weight = 1.0 if self.readings == 0 else CALIBRATION_WEIGHT
        self.factor += (ratio - self.factor) * weight
        self.readings += 1

    def scale(self, tokens: int) -> int:
        """``tokens`` raw estimated tokens as the model is expected to count them."""
        return math.ceil(tokens * self.factor)
