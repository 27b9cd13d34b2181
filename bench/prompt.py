"""``python -m bench prompt``: the fixed prompt's tokens per part (target T8 of
docs/performance.md; decision 0295).

Counts with a real tokenizer, OpenAI's ``cl100k_base`` (``bench.cl100k``, offline), what
every turn's model request carries before the conversation:

- the built-in instructions (``service.core.prompts``);
- the project block (project and organization) and the planner skill block of the demo
  project as ``ballet-planner dev`` serves it (``devstack.demo``);
- each tool declaration as a Chat Completions ``tools`` entry, compact JSON
  (``{"type": "function", "function": {"name", "description", "parameters"}}``), and the
  whole ``tools`` array, compact and as a template's ``tojson`` renders it;
- the estimate the planner uses without a tokenizer (``service.core.estimate``), beside
  each real count.

Target: the instructions plus the twelve declarations (the compact array) at most
``TARGET_TOKENS``. A chat template adds its own markup around these parts. ``--json``
prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from service.core import prompts
from service.core.context import project_block, skill_block
from service.core.estimate import text_tokens
from service.core.ports import ProjectInfo, SkillDocument, ToolDeclaration
from service.core.tools import declarations

#: Target T8: the instructions plus the twelve tool declarations, in cl100k_base tokens.
TARGET_TOKENS = 2000


@dataclass(frozen=True)
class Part:
    """One part of the fixed prompt: its cl100k_base tokens, the planner's estimate of
    it, and its UTF-8 bytes."""

    name: str
    tokens: int
    estimate: int
    utf8_bytes: int


def tool_entry(declaration: ToolDeclaration) -> str:
    """A declaration as one compact Chat Completions ``tools`` entry (what
    ``devstack.gateway.openai_provider`` sends, serialized without spaces)."""
    entry = {
        "type": "function",
        "function": {
            "name": declaration.name,
            "description": declaration.description,
            "parameters": json.loads(declaration.parameters_json_schema),
        },
    }
    return json.dumps(entry, separators=(",", ":"), ensure_ascii=False)


def tools_array(offered: Sequence[ToolDeclaration]) -> str:
    """The compact ``tools`` array of ``offered``."""
    return "[" + ",".join(tool_entry(d) for d in offered) + "]"


def tools_tojson(offered: Sequence[ToolDeclaration]) -> str:
    """The ``tools`` array as a Jinja chat template's ``tojson`` renders it (``", "`` and
    ``": "`` separators), the form llama.cpp and Hugging Face templates put in a prompt."""
    return json.dumps([json.loads(tool_entry(d)) for d in offered], ensure_ascii=False)


def demo_project() -> tuple[ProjectInfo, SkillDocument]:
    """The demo project and its pinned planner skill as ``ballet-planner dev`` serves
    them (``devstack.demo.project``)."""
    from devstack.demo import project as demo
    from devstack.store.access import ORGANIZATIONS

    info = ProjectInfo(
        project_id=demo.PROJECT_ID,
        name="Pantry (demo)",
        description="A household pantry app: the built-in demo project of ballet-planner dev.",
        organization_id=demo.ORG_ID,
        organization_name=ORGANIZATIONS[demo.ORG_ID],
        planner_skill=demo.PLANNER_SKILL,
        model_credential=demo.MODEL_CREDENTIAL,
    )
    return info, SkillDocument(demo.PLANNER_SKILL, "1.0.0", demo._DEMO_PLANNING_1_0)


def measure(count: Callable[[str], int] | None = None) -> list[Part]:
    """Every part, then the totals: ``tools (array)``, ``instructions + tools`` (the T8
    figure) and ``fixed prompt`` (all of it). ``count`` is the tokenizer (cl100k_base
    by default)."""
    from bench import cl100k

    tokens = count or cl100k.count
    project, skill = demo_project()
    offered = declarations()
    texts = [
        ("instructions", prompts.instructions()),
        ("project block", project_block(project, None)),
        ("skill block", skill_block(skill)),
        *((f"tool {d.name}", tool_entry(d)) for d in offered),
    ]
    array = tools_array(offered)
    texts += [
        ("tools (array)", array),
        ("tools (tojson)", tools_tojson(offered)),
        ("instructions + tools", prompts.instructions() + array),
        ("fixed prompt", build_fixed(project, skill, array)),
    ]
    return [Part(name, tokens(text), text_tokens(text), len(text.encode())) for name, text in texts]


def build_fixed(project: ProjectInfo, skill: SkillDocument, array: str) -> str:
    """Instructions, tools and the project's block, concatenated (no template markup)."""
    return prompts.instructions() + array + project_block(project, skill)


def table(parts: Sequence[Part]) -> str:
    lines = [
        "| part | cl100k_base tokens | estimate | UTF-8 bytes |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {p.name} | {p.tokens:,} | {p.estimate:,} | {p.utf8_bytes:,} |" for p in parts]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench prompt", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    parts = measure()
    if args.json:
        print(json.dumps([asdict(p) for p in parts], indent=2))
    else:
        print(table(parts))
    lean = next(p for p in parts if p.name == "instructions + tools")
    verdict = "within" if lean.tokens <= TARGET_TOKENS else "OVER"
    print(f"\ninstructions + tools: {lean.tokens:,} cl100k_base tokens, {verdict} the "
          f"target of {TARGET_TOKENS:,} (T8)")  # fmt: skip
    return 0 if lean.tokens <= TARGET_TOKENS else 1
