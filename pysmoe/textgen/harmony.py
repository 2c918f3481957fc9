"""gpt-oss's output format (OpenAI's "harmony") → OpenAI message parts: reasoning, content and
tool calls.

The prompt ends with `<|start|>assistant`; the model then writes one or more messages, each a
header, `<|message|>`, a body and an end:

    <|channel|>analysis<|message|>We need the weather...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

A header names the channel (`<|channel|>analysis`, `commentary`, `final`) and, for a tool call,
the recipient (`to=functions.NAME`, before or after the channel), optionally a content type
(`<|constrain|>json` or a bare `json`). What becomes what:
  - analysis → reasoning_content;
  - final, and commentary addressed to nobody (a "preamble" the user may see) → content;
  - a message to `functions.NAME`, when the request offered tools, whose body is valid JSON → a
    tool call (arguments: the body, a JSON string); a body that is not JSON, or a call when no
    tools were offered, is content, verbatim;
  - a message to a built-in tool (browser.*, python) → reasoning (it is the model's own work).
`<|return|>` and `<|call|>` are end-of-sequence ids (generation_config.json), so the text rarely
shows them: the end of the text ends the last message. Text that does not open with a header
(a model that ignores the format) is content, as it came.

The parser is fed text in pieces of any size and holds back only what could still be a tag (a
trailing `<|en`) or an unfinished header; a tool call is emitted when its message ends, as two
deltas in OpenAI's shape (index/id/type/name, then the arguments), as Qwen3Parser does. The tags
are special tokens of gpt-oss's tokenizer; the detokenizer keeps them (text.KEEP_TAGS).
"""
from __future__ import annotations

import json

from .qwen3 import MessageDelta, StreamParser, _partial_tag, new_call_id

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL, START)   # what ends a body (a new <|start|> too, when <|end|> was left out)
MAX_HEADER = 256                    # characters of a header before it is taken for plain text


def uses_harmony(template: str | None) -> bool:
    """Whether a chat template speaks harmony (gpt-oss's)."""
    return bool(template) and CHANNEL in template and "<|start|>assistant" in template


def _header(text: str) -> tuple[str, str | None]:
    """(channel, recipient or None) of a header such as `<|start|>assistant to=functions.f<|channel|>commentary json`."""
    channel, recipient = "", None
    i = text.find(CHANNEL)
    if i >= 0:
        rest = text[i + len(CHANNEL):].replace(CONSTRAIN, " ")
        words = rest.split()
        channel = words[0] if words else ""
    for word in text.replace(CHANNEL, " ").replace(CONSTRAIN, " ").replace(START, " ").split():
        if word.startswith("to="):
            recipient = word[3:]
    return channel, recipient


class HarmonyParser(StreamParser):
    """feed(text) → MessageDelta; finish() → the held rest; message() → the whole message. The
    interface of Qwen3Parser. tools: parse calls to `functions.*` (only when the request offered
    tools); call_id: makes each tool call's id."""

    def __init__(self, *, tools: bool = False, call_id=new_call_id):
        self.tools_on = tools
        self.call_id = call_id
        self.mode = "header"           # header | body | plain
        self.buf = ""
        self.channel, self.recipient = "", None
        self.body = ""                 # a tool call's body, until its message ends
        self.calls = 0
        self.content = self.reasoning = ""
        self.tool_calls: list[dict] = []

    # --------------------------------------------------------------------------- emitting
    def _emit(self, out: MessageDelta, text: str) -> None:
        if not text:
            return
        if self._is_call():
            self.body += text
        elif self.channel == "analysis" or (self.recipient is not None and not self.recipient.startswith("functions.")):
            out.reasoning += text
            self.reasoning += text
        else:
            out.content += text
            self.content += text

    def _is_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith("functions.")

    def _end_message(self, out: MessageDelta) -> None:
        if self._is_call():
            body, self.body = self.body.strip(), ""
            name = self.recipient[len("functions."):]
            try:
                json.loads(body)
                valid = bool(name)
            except (ValueError, RecursionError):
                valid = False
            if self.tools_on and valid:
                self._call(out, name, body)
            else:
                out.content += body
                self.content += body
        self.channel, self.recipient = "", None

    # --------------------------------------------------------------------------- parsing
    def _step(self, out: MessageDelta, final: bool) -> bool:
        """Consume what can be decided of buf; True when the mode changed (go again)."""
        buf = self.buf
        if self.mode == "plain":
            self.buf = ""
            out.content += buf
            self.content += buf
            return False
        if self.mode == "header":
            i = buf.find(MESSAGE)
            if i >= 0:
                self.channel, self.recipient = _header(buf[:i])
                self.mode, self.buf = "body", buf[i + len(MESSAGE):]
                return True
            s = buf.lstrip()
            looks_like_header = not s or s.startswith(("<|", "to=")) or "<|".startswith(s) or "to=".startswith(s)
            if not looks_like_header or len(buf) > MAX_HEADER:
                self.mode = "plain"
                return True
            if final:  # a header the text never finished: nothing to show
                self.buf = ""
            return False
        # mode == "body"
        hits = [(j, t) for j, t in ((buf.find(t), t) for t in ENDS) if j >= 0]
        if hits:
            j, tag = min(hits)
            self._emit(out, buf[:j])
            self._end_message(out)
            # a body cut short by <|start|> goes straight into the next header
            self.mode, self.buf = "header", buf[j + len(tag):] if tag != START else buf[j:]
            return True
        if final:
            self._emit(out, buf)
            self.buf = ""
            self._end_message(out)
            self.mode = "header"
            return False
        k = max(_partial_tag(buf, t) for t in ENDS)
        self._emit(out, buf[:len(buf) - k])
        self.buf = buf[len(buf) - k:]
        return False

