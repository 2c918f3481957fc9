"""Qwen3's output format → OpenAI message parts: reasoning, content and tool calls.

Qwen3 writes its thinking as `<think>\\n...\\n</think>\\n\\n` before the answer (with
enable_thinking false the template puts an empty block in the prompt and the model writes none),
and a tool call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a
row when it calls several.

The parser is fed text in pieces of any size and returns MessageDelta parts; it holds back only
what could still turn out to be a tag (a trailing `<thi`), or whitespace whose fate the next text
decides. The rules, the same whatever the pieces:
  - `<think>` is a tag only at the start of the output (after whitespace at most), or the output
    starts inside the block when the prompt ends with an open `<think>` (starts_in_reasoning);
  - reasoning is the block's text without its leading and trailing whitespace; the whitespace
    between `</think>` and the content is dropped; an unclosed block is all reasoning;
  - with tools on, `<tool_call>BODY</tool_call>` whose BODY is a JSON object with a string
    "name" (and "arguments", an object or a JSON string, default {}) becomes a tool call whose
    arguments are a JSON string; the whitespace around a tool call is dropped; a BODY that is
    not such JSON, or a tag never closed, is content, verbatim;
  - whitespace at the very end of the content is kept unless a tool call was made.
A tool call is emitted when its closing tag arrives, as two deltas in OpenAI's shape: the first
with index, id, type and name and empty arguments, the second with the arguments. (The model
writes a call in a few dozen tokens; streaming its arguments before the JSON is known valid
would make the malformed-JSON fallback to content impossible.)
"""
from __future__ import annotations

import dataclasses
import json
import uuid

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of tool call `index`: the first piece of a call has id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        fn: dict = {}
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        d["function"] = fn
        return d


@dataclasses.dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: "MessageDelta") -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _split_ws(text: str) -> tuple[str, str]:
    """(text without its trailing whitespace, that whitespace)."""
    body = text.rstrip()
    return body, text[len(body):]


def parse_tool_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a tool call's body, or None if it is not one."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return obj["name"], args
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class StreamParser:
    """What every output parser shares (pysmoe.textgen.formats): a subclass keeps buf (text not
    decided yet), content, reasoning, tool_calls, calls and call_id, and defines _step(out, final),
    which consumes what can be decided of buf and says whether to go again."""

    def feed(self, text: str) -> MessageDelta:
        out = MessageDelta()
        self.buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> MessageDelta:
        out = MessageDelta()
        while self._step(out, final=True):
            pass
        return out

    def _call(self, out: MessageDelta, name: str, args: str) -> None:
        cid = self.call_id()
        out.tool_calls.append(ToolCallDelta(self.calls, id=cid, name=name, arguments=""))
        out.tool_calls.append(ToolCallDelta(self.calls, arguments=args))
        self.tool_calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        self.calls += 1

    def message(self) -> dict:
        """The whole message so far, OpenAI's shape (content None when there is none)."""
        msg: dict = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        return msg


class Qwen3Parser(StreamParser):
    """feed(text) → MessageDelta; finish() → the held rest. reasoning: parse `<think>` blocks;
    tools: parse `<tool_call>` blocks (only when the request offered tools; true, or the
    request's tools list, whose parameter schemas formats with untyped values read); call_id:
    makes each tool call's id. Every output parser (pysmoe.textgen.formats) has this shape."""

    def __init__(self, *, reasoning: bool = True, tools=False, starts_in_reasoning: bool = False,
                 call_id=new_call_id):
        self.reasoning_on, self.tools_on = reasoning, bool(tools)
        self.tools = tools if isinstance(tools, list) else []  # the request's tools, when given as the list
        self.mode = "reasoning" if (reasoning and starts_in_reasoning) else ("start" if reasoning else "content")
        self.buf = ""                 # text not decided yet
        self.lead = True              # drop leading whitespace of the current part
        self.ws_before_call = ""      # whitespace dropped before a <tool_call>, restored if it is not one
        self.calls = 0
        self.call_id = call_id
        self.content = self.reasoning = ""
        self.tool_calls: list[dict] = []

    # --------------------------------------------------------------------------- emitting
    def _content(self, out: MessageDelta, text: str) -> None:
        if self.lead:
            text = text.lstrip()
            if not text:
                return
            self.lead = False
        out.content += text
        self.content += text

    def _reasoning(self, out: MessageDelta, text: str) -> None:
        if self.lead:
            text = text.lstrip()
            if not text:
                return
            self.lead = False
        out.reasoning += text
        self.reasoning += text

    # --------------------------------------------------------------------------- parsing
    def _step(self, out: MessageDelta, final: bool) -> bool:
        """Consume what can be decided of buf; True when the mode changed (go again)."""
        buf = self.buf
        if self.mode == "start":
            s = buf.lstrip()
            if s.startswith(THINK):
                self.mode, self.buf, self.lead = "reasoning", s[len(THINK):], True
                return True
            if not final and THINK.startswith(s):  # empty, or the start of <think>
                return False
            self.mode, self.lead = "content", False
            return True
        if self.mode == "reasoning":
            i = buf.find(END_THINK)
            if i >= 0:
                self._reasoning(out, buf[:i].rstrip())
                self.mode, self.buf, self.lead = "content", buf[i + len(END_THINK):], True
                return True
            if final:
                self._reasoning(out, buf.rstrip())
                self.buf = ""
                return False
            k = _partial_tag(buf, END_THINK)
            body, ws = _split_ws(buf[:len(buf) - k])
            self._reasoning(out, body)
            self.buf = ws + buf[len(buf) - k:]
            return False
        if self.mode == "content":
            i = buf.find(CALL) if self.tools_on else -1
            if i >= 0:
                body, ws = _split_ws(buf[:i])
                self._content(out, body)
                self.ws_before_call = "" if self.lead else ws
                self.mode, self.buf = "call", buf[i + len(CALL):]
                return True
            if final:
                body, ws = _split_ws(buf)
                self._content(out, body if self.calls else buf)
                self.buf = ""
                return False
            k = _partial_tag(buf, CALL) if self.tools_on else 0
            body, ws = _split_ws(buf[:len(buf) - k])
            self._content(out, body)
            self.buf = ws + buf[len(buf) - k:]
            return False
        # mode == "call"
        i = buf.find(END_CALL)
        if i < 0 and not final:
            return False
        raw = CALL + (buf if i < 0 else buf[:i + len(END_CALL)])
        parsed = self.parse_call(buf[:i]) if i >= 0 else None
        if parsed is None:  # not a tool call: the text as it came, whitespace before it too
            self._content(out, self.ws_before_call + raw)
            self.lead = False
        else:
            self._call(out, *parsed)
            self.lead = True
        self.ws_before_call = ""
        self.mode, self.buf = "content", ("" if i < 0 else buf[i + len(END_CALL):])
        return True

    def parse_call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as a JSON string) of a `<tool_call>` block's body, None when it is not
        a call (it is then content). The formats that share Qwen3's tags differ only here."""
        return parse_tool_call(body)

