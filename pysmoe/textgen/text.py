"""From ids to text a stream can show: the incremental detokenizer and the stop-string matcher.

Detokenizer: a byte-level BPE splits multi-byte UTF-8 characters across tokens, so decoding
one token at a time shows U+FFFD where half a character is. It decodes a short window of ids
instead — from the last point where the text was known complete (prefix) to the newest id — and
shows what that window adds beyond its prefix, holding it back while it ends in U+FFFD (the next
id may complete the character). The concatenation of what it shows, then flush(), is exactly
tokenizer.decode(all ids).

StopMatcher: stop strings are matched in the text, across token boundaries. Text that could be
the start of a stop string is held back until the next text resolves it; at the first
occurrence of any stop string the text before it is shown and the rest (the stop string
included) never is. The concatenation of what it shows is exactly the brute-force answer:
the whole text cut at its earliest stop-string occurrence.
"""
from __future__ import annotations


# Tags an output parser reads: kept even where a checkpoint marks them special tokens.
KEEP_TAGS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>",
                       # GLM-4.5's call syntax (textgen/xmlcalls.py)
                       "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                       # gpt-oss's harmony (textgen/harmony.py)
                       "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"})


class Detokenizer:
    """push(id) → the new text; flush() → what is still held (a character the ids never
    completed, as U+FFFD) at the end. Special tokens (<|im_end|>) show no text, except the
    tags of KEEP_TAGS, which the output parsers need to see."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.hidden = frozenset(_special_ids(tokenizer)) if skip_special_tokens else frozenset()
        self.ids: list[int] = []
        self.prefix = 0     # window start: ids[:prefix] are shown and end at a character boundary
        self.read = 0       # ids[prefix:read] decode to the text already shown from the window

    def _decode(self, ids) -> str:
        return self.tok.decode([i for i in ids if i not in self.hidden], skip_special_tokens=False)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if not final and (full.endswith("\ufffd") or len(full) <= len(shown)):
            return ""
        new = full[len(shown):] if full.startswith(shown) else full
        self.prefix, self.read = self.read, len(self.ids)
        return new


def _special_ids(tokenizer) -> list[int]:
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:
        return []
    return [int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special and t.content not in KEEP_TAGS]


def _held_suffix(text: str, stops) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopMatcher:
    """push(text) → (text to show, stopped); once stopped, everything after is dropped.
    flush() → the held text, when generation ended for another reason."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        return self._resolve(self.held + text, final=False)

    def flush(self) -> tuple[str, bool]:
        """At the end: (the held text up to a stop string in it, whether there was one)."""
        if self.stopped:
            return "", True
        held, self.held = self.held, ""
        return self._resolve(held, final=True) if held else ("", False)

    def _resolve(self, s: str, final: bool) -> tuple[str, bool]:
        i = first_stop(s, self.stops)
        # A stop string that begins earlier and is not complete yet may still win: hold from there.
        k = 0 if final else _held_suffix(s, self.stops)
        if i is not None and i <= len(s) - k:
            self.held, self.stopped = "", True
            self.matched = next(x for x in self.stops if s.find(x) == i)
            return s[:i], True
        self.held = s[len(s) - k:] if k else ""
        return s[:len(s) - k], False


def first_stop(text: str, stops) -> int | None:
    """The brute-force reference: where the earliest stop string begins in text (None: nowhere)."""
    hits = [i for i in (text.find(x) for x in stops) if i >= 0]
    return min(hits) if hits else None
