"""Output formats: which parser reads a chat reply into reasoning, content and tool calls.

FORMATS maps a format's name to its parser class (or any factory called with the keywords
reasoning, tools and starts_in_reasoning). Every parser has Qwen3Parser's shape:

    Parser(reasoning=True, tools=False | True | [tools], starts_in_reasoning=False)
    .feed(text) -> MessageDelta     .finish() -> MessageDelta     .message() -> dict
    .tool_calls                     (the calls so far, OpenAI's shape)

    "qwen3"        Qwen3-MoE, Qwen3-Next: <think> reasoning, <tool_call>{JSON}</tool_call>
                   (pysmoe/textgen/qwen3.py); also the default for an unknown model
    "qwen3_coder"  Qwen3.5-MoE, Qwen3.6-MoE, Qwen3-Coder: <think>, <tool_call><function=NAME>
                   <parameter=K>… (pysmoe/textgen/xmlcalls.py)
    "glm45"        GLM-4.5 / 4.6 / Air: <think>, <tool_call>NAME<arg_key>K</arg_key><arg_value>…
                   (pysmoe/textgen/xmlcalls.py)
    "harmony"      gpt-oss: analysis/final channels and its tool calls (pysmoe/textgen/harmony.py)
    "plain"        Mixtral-Instruct, OLMoE-Instruct: no reasoning, no tool-call syntax: the
                   reply is content

Another family's parser plugs in with register(name, factory, model_types=(...)) and, if its
template says so, a rule in format_of.

format_of(model_type, template) picks the name. The template decides first, because it is what
taught the model how to write a call (a Qwen3-Next vault whose template teaches the XML form
gets the XML parser): `<arg_key>` → glm45; `<function=` with `<parameter=` → qwen3_coder;
`<tool_call>` or `<think>` → qwen3; harmony's `<|channel|>` tags (before all of these) → harmony. A template that shows none of them is read by the vault's
config.json `model_type` (FAMILY_FORMATS), and an unknown one gets qwen3, whose parser leaves a
reply without its tags as plain content.
"""
from __future__ import annotations

from .harmony import HarmonyParser, uses_harmony
from .qwen3 import Qwen3Parser
from .xmlcalls import Glm45Parser, Qwen3CoderParser


class PlainParser(Qwen3Parser):
    """A reply that is all content: the format has no reasoning block and no call syntax."""

    def __init__(self, *, reasoning: bool = True, tools=False, starts_in_reasoning: bool = False, **kw):
        super().__init__(reasoning=False, tools=False, starts_in_reasoning=False, **kw)


FORMATS: dict = {
    "qwen3": Qwen3Parser,
    "qwen3_coder": Qwen3CoderParser,
    "glm45": Glm45Parser,
    "harmony": lambda reasoning=True, tools=False, starts_in_reasoning=False: HarmonyParser(tools=tools),
    "plain": PlainParser,
}

# config.json model_type → format, for a template that does not say.
FAMILY_FORMATS: dict[str, str] = {
    "qwen3_moe": "qwen3",
    "qwen3_next": "qwen3",
    "qwen3_5_moe": "qwen3_coder",
    "qwen3_5_moe_text": "qwen3_coder",
    "glm4_moe": "glm45",
    "mixtral": "plain",
    "olmoe": "plain",
    "gpt_oss": "harmony",
}

DEFAULT_FORMAT = "qwen3"


def register(name: str, parser, *, model_types: tuple[str, ...] = ()) -> None:
    """Add a format (and the model_types it is the default of). parser: a class or factory taking
    the keywords reasoning, tools and starts_in_reasoning."""
    FORMATS[name] = parser
    for t in model_types:
        FAMILY_FORMATS[t] = name


def format_of(model_type: str | None = None, template: str | None = None) -> str:
    """The name of the format a vault's replies are in (module docstring)."""
    if template:
        if uses_harmony(template):
            return "harmony"
        if "<arg_key>" in template:
            return "glm45"
        if "<function=" in template and "<parameter=" in template:
            return "qwen3_coder"
        if "<tool_call>" in template or "<think>" in template:
            return "qwen3"
    return FAMILY_FORMATS.get(model_type or "", DEFAULT_FORMAT)


def make_parser(fmt: str = DEFAULT_FORMAT, *, reasoning: bool = True, tools=False, starts_in_reasoning: bool = False):
    """A new parser of format fmt (KeyError names the formats there are)."""
    try:
        cls = FORMATS[fmt]
    except KeyError:
        raise KeyError(f"no output format {fmt!r}; there are {', '.join(sorted(FORMATS))}") from None
    return cls(reasoning=reasoning, tools=tools, starts_in_reasoning=starts_in_reasoning)
