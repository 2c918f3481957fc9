"""Chat prompts: OpenAI messages through the checkpoint's chat template, and token texts.

render_chat() takes messages as the OpenAI API sends them and renders them with the vault's
template (pysmoe/tokenizer.py renders like transformers' apply_chat_template):
  - content given as a list of parts keeps its text parts, joined; None becomes "";
  - an assistant message's tool_calls keep OpenAI's shape ({"id", "type", "function": {"name",
    "arguments"}}), with arguments (a JSON string in the API) parsed back into an object when
    it is valid JSON, as transformers documents templates to expect (Qwen3's takes either);
  - `tools` goes to the template as given (a list of {"type": "function", "function": {...}});
  - chat_template_kwargs become template variables (Qwen3: {"enable_thinking": false}).
  - gpt-oss's template (harmony) takes `reasoning_effort` ("low", "medium", "high") this way.
It returns the ids, the text, whether the prompt leaves the model inside a `<think>` block, and
the output format its model writes (format: "harmony" for gpt-oss's template, else "qwen3").
"""
from __future__ import annotations

import dataclasses
import functools
import json

from ..errors import InvalidArgument
from .harmony import uses_harmony

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str
    starts_in_reasoning: bool    # the rendering ends inside an open <think> block
    format: str = "qwen3"        # the output format the template's model writes: "qwen3" or "harmony" (gpt-oss)


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise InvalidArgument(f"{where}: only text content parts are supported, got {p!r:.80}")
        return "".join(parts)
    raise InvalidArgument(f"{where}: content must be a string or a list of text parts")


def _tool_call(call, where: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidArgument(f"{where}: a tool call is "
                              "{'id', 'type': 'function', 'function': {'name', 'arguments'}}")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's recursion limit
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**call, "function": fn}


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages → what chat templates read (InvalidArgument names the bad one)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgument("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidArgument(f"{where}: a message is an object with a role among {', '.join(ROLES)}")
        m = dict(m)
        if m["role"] == "developer":  # OpenAI's newer name for the system role
            m["role"] = "system"
        m["content"] = _text_of(m.get("content"), where)
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise InvalidArgument(f"{where}: tool_calls must be a list")
            m["tool_calls"] = [_tool_call(c, where) for c in m["tool_calls"]]
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def render_chat(tokenizer, messages, *, tools=None, chat_template_kwargs: dict | None = None,
                add_generation_prompt: bool = True, check_text=None) -> ChatPrompt:
    """The prompt of a chat request under the tokenizer's template. Whatever rendering these
    messages raises (jinja's raise_exception, a bad variable, a TypeError or OverflowError inside
    the template) gives InvalidArgument with its message; so do tools given to a template that
    does not use them (they would be dropped silently). check_text(text), when given, sees the
    rendered text before it is tokenised (the server refuses there a prompt that cannot fit)."""
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("messages", "tools", "add_generation_prompt", "tokenize"):
        if reserved in kwargs:
            raise InvalidArgument(f"chat_template_kwargs may not set {reserved!r}")
    if tools is not None and not isinstance(tools, list):
        raise InvalidArgument("tools must be a list")
    import jinja2

    msgs = normalize_messages(messages)

    def render(tools):
        try:
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                 tools=tools or None, **kwargs)
        except InvalidArgument:
            raise
        except Exception as e:  # noqa: BLE001 - the template's code ran on the caller's messages
            why = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise InvalidArgument(f"the chat template refused these messages: {why}") from None

    text = render(tools)
    if tools and text == render(None):
        raise InvalidArgument("this model's chat template does not use tools: send the request without them, "
                              "or describe the tools in a message")
    if check_text is not None:
        check_text(text)
    fmt = "harmony" if uses_harmony(getattr(tokenizer, "chat_template", None)) else "qwen3"
    return ChatPrompt(tokenizer.encode(text), text, fmt == "qwen3" and ends_in_reasoning(text), fmt)


def ends_in_reasoning(prompt_text: str) -> bool:
    """True when the prompt opens a <think> block that it does not close (Qwen3 thinking-only
    templates put `<think>\\n` after the assistant's opening)."""
    i = prompt_text.rfind("<think>")
    return i >= 0 and prompt_text.find("</think>", i) < 0 and prompt_text.rfind("<|im_start|>") < i


# ------------------------------------------------------------------------------- token texts

@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: each of the 256 bytes is written as one printable
    character — itself when it is printable Latin-1, else chr(256 + n) for the n-th of the others."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for (a byte-level token may be half a UTF-8 character)."""
    hf = tokenizer._tok
    piece = hf.id_to_token(int(token)) if 0 <= int(token) < tokenizer.vocab_size else None
    if piece is None:
        return b""
    added = _added(tokenizer)
    if int(token) in added:
        return added[int(token)].encode("utf-8")
    if type(hf.decoder).__name__ == "ByteLevel":
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return tokenizer.decode([int(token)], skip_special_tokens=False).encode("utf-8")


def _added(tokenizer) -> dict[int, str]:
    cached = getattr(tokenizer, "_textgen_added", None)
    if cached is None:
        cached = {int(i): t.content for i, t in tokenizer._tok.get_added_tokens_decoder().items()}
        tokenizer._textgen_added = cached
    return cached


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    """(text, bytes as a list of ints) of one token, as OpenAI's logprobs entries give them."""
    b = token_bytes(tokenizer, token)
    return b.decode("utf-8", errors="replace"), list(b)
