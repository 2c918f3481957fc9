"""python -m pysmoe chat: a conversation through the vault's chat template.

The session keeps the conversation's KV from turn to turn. Each turn renders the whole
conversation with the template; when the ids already fed are a prefix of that rendering (the
usual case) only the rest is prefilled, otherwise (a template that rewrites earlier turns, a
reply that re-tokenises differently, /system) the session is reset and the whole conversation
re-prefilled: exact either way. When the next turn would not fit the context, the oldest turns
are dropped (the system prompt is kept) and stderr says so.

Lines starting with "/" are commands (/help lists them), never sent to the model. Ctrl-C during
a reply stops it and returns to the prompt; Ctrl-C at the prompt twice in a row, Ctrl-D or /exit
quits. On a terminal, lines are edited with readline and kept in a history file.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
from typing import Iterator

from .args import add_sampling_args, add_session_args, add_template_args, open_session, sampling_kwargs

HELP = """commands (not sent to the model):
  /help          this list
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (/system alone removes it)
  /exit          quit (also /quit, Ctrl-D, or Ctrl-C twice at the prompt)
  //TEXT         send TEXT starting with "/"
Ctrl-C during a reply stops it."""


def add_parser(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--system", default=None, help="system prompt (change it with /system TEXT)")
    add_template_args(p)
    add_session_args(p)
    add_sampling_args(p)


class TurnTooLong(ValueError):
    """The message alone, with room for the reply, does not fit the context."""


class Conversation:
    """The messages of a chat and the ids whose KV the session holds (`fed`)."""

    def __init__(self, session, tokenizer, system: str | None = None, max_tokens: int = 64,
                 template_kwargs: dict | None = None, chat_format: str | None = None, **sampling):
        self.session, self.tok = session, tokenizer
        # how replies read (reasoning, content, calls): reply_format(vault), or the template's say
        self.chat_format = chat_format or reply_format(None, tokenizer)
        self.starts_in_reasoning = False  # the last turn's prompt left a <think> block open
        self.template_kwargs = dict(template_kwargs or {})  # e.g. Qwen3's {"enable_thinking": False}
        self.system = system or None
        self.turns: list[dict] = []    # user and assistant messages, oldest first
        self.fed: list[int] = []       # the ids in the session's KV, in order
        self.max_tokens, self.sampling = max_tokens, sampling
        self.kept = 0                  # prompt ids of the last turn that were already in the KV
        self.dropped = 0               # turns the last reply dropped to fit the context

    def messages(self, extra: list[dict] = ()) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns + list(extra)

    def reset(self) -> None:
        self.turns, self.fed = [], []
        self.session.reset()

    def _fit(self, user: dict) -> list[int]:
        """The rendering of the conversation plus user, dropping the oldest turns (never the
        system prompt) until it leaves room for max_tokens of reply, or for half the context when
        max_tokens is more (the reply then ends when the context is full, as run's does)."""
        from ..textgen import render_chat
        self.dropped = 0
        reply = min(self.max_tokens, self.session.context // 2)
        room = self.session.context - reply
        while True:
            prompt = render_chat(self.tok, self.messages([user]), chat_template_kwargs=self.template_kwargs)
            ids = prompt.ids
            if len(ids) <= room:
                self.starts_in_reasoning = prompt.starts_in_reasoning
                return ids
            if not self.turns:
                raise TurnTooLong(f"this message ({len(ids)} tokens with the conversation's template) and "
                                  f"{reply} tokens of reply do not fit the context of {self.session.context}")
            # a user message and its reply (a turn whose reply was interrupted may lack one)
            del self.turns[:2 if len(self.turns) > 1 and self.turns[1]["role"] == "assistant" else 1]
            self.dropped += 1

    def _assistant(self, text: str) -> dict:
        """The reply as the next turn's template takes it: gpt-oss's harmony text parsed (its final
        channel as content: its template refuses channel tags in content and drops the analysis)."""
        from ..textgen.harmony import HarmonyParser, uses_harmony
        if not uses_harmony(getattr(self.tok, "chat_template", None)):
            return {"role": "assistant", "content": text}
        p = HarmonyParser()
        p.feed(text)
        p.finish()
        return {"role": "assistant", "content": p.content}

    def reply(self, text: str) -> Iterator:
        """Send a user message; yields GenerationResponse records of the reply. Close the
        iterator (contextlib.closing) if you stop early: that is what records the reply."""
        from ..generate import interruptible, stream_generate
        user = {"role": "user", "content": text}
        ids = self._fit(user)
        n = len(self.fed)
        if not (0 < n < len(ids) and ids[:n] == self.fed):
            self.session.reset()
            self.fed, n = [], 0
        self.kept = n
        self.turns.append(user)
        todo = self.fed + ids[n:]  # what the session will have fed, in order, as far as it gets
        reply = []
        try:
            for r in interruptible(self.session, stream_generate(self.session, ids[n:], self.max_tokens,
                                                                 **self.sampling)):
                todo.append(r.token)
                reply.append(r.text)
                yield r
        finally:
            # Interrupted (Ctrl-C, an error) or not, the KV holds the first `position` ids of
            # todo: prompt ids are fed in order, and each generated id is fed before the next
            # one is sampled (interruptible keeps the worker in lockstep with this loop, and a
            # Ctrl-C cancels the call in flight, which rewinds).
            self.fed = todo[:self.session.position]
            if reply:
                self.turns.append(self._assistant("".join(reply)))
            else:  # nothing was answered: forget the question (the next turn re-prefills)
                self.turns.pop()


def reply_format(vault, tokenizer) -> str:
    """The format a vault's chat replies are in, chosen as the server chooses it (textgen.format_of:
    the template first, then config.json's model_type)."""
    from ..textgen import format_of
    model_type = vault.config.get("model_type") if vault is not None else None
    return format_of(model_type, getattr(tokenizer, "chat_template", None))


class ReplyView:
    """Shows a chat reply as its format's parser reads it (the server's parsers): the reasoning on
    stderr, dimmed on a terminal; the content on stdout; each tool call as a note on stderr when the
    reply ends. Harmony's channel tags and the families' call tags are never printed. show=False
    only parses (run --json)."""

    def __init__(self, chat_format: str, starts_in_reasoning: bool = False, show: bool = True):
        from ..textgen import make_parser
        self.parser = make_parser(chat_format, reasoning=True, tools=True, starts_in_reasoning=starts_in_reasoning)
        self.show = show
        self.out, self.err = sys.stdout, sys.stderr
        self.dim = self.err.isatty()
        self.thinking = False  # the last thing shown was reasoning

    def feed(self, text: str) -> None:
        self._show(self.parser.feed(text))

    def finish(self) -> dict:
        """Show what the parser held back and the tool calls; the reply as an OpenAI message."""
        self._show(self.parser.finish())
        if not self.show:
            return self.parser.message()
        if self.thinking:
            print(file=self.err, flush=True)
            self.thinking = False
        for call in self.parser.tool_calls:
            f = call["function"]
            print(f"[tool call {f['name']}({f['arguments']})]", file=self.err, flush=True)
        return self.parser.message()

    def _show(self, delta) -> None:
        if not self.show:
            return
        if delta.reasoning:
            self.err.write(f"\x1b[2m{delta.reasoning}\x1b[0m" if self.dim else delta.reasoning)
            self.err.flush()
            self.thinking = True
        if delta.content:
            if self.thinking:
                print(file=self.err, flush=True)
                self.thinking = False
            self.out.write(delta.content)
            self.out.flush()


def history_file() -> pathlib.Path:
    state = os.environ.get("XDG_STATE_HOME")
    if state:
        return pathlib.Path(state) / "pysmoe" / "history"
    return pathlib.Path.home() / ".pysmoe_history"


@contextlib.contextmanager
def line_editing(enabled: bool):
    """readline editing and a history file, on a terminal."""
    if not enabled:
        yield
        return
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input()
        yield
        return
    path = history_file()
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)


def note(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)


def command(conv: Conversation, line: str) -> bool:
    """Run a /command; False when it asks to quit."""
    name, _, rest = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        print(HELP, file=sys.stderr)
    elif name == "/reset":
        conv.reset()
        note("conversation cleared" + (" (system prompt kept)" if conv.system else ""))
    elif name == "/system":
        conv.system = rest.strip() or None
        note(f"system prompt set: {conv.system}" if conv.system else "system prompt removed")
    else:
        note(f"unknown command {name}: /help lists them; //TEXT sends TEXT starting with /")
    return True


def run(args) -> int:
    vault, session = open_session(args)
    with vault, session:
        tok = vault.tokenizer
        if tok is None:
            print("pysmoe chat: error: this vault has no tokenizer.json", file=sys.stderr)
            return 2
        conv = Conversation(session, tok, args.system, args.max_tokens, template_kwargs=args.chat_template_kwargs,
                            chat_format=reply_format(vault, tok), **sampling_kwargs(args))
        interactive = sys.stdin.isatty()
        if interactive:
            note(f"chat with {vault.path}: /help for commands, Ctrl-D to quit")
        with line_editing(interactive):
            return _loop(conv, interactive)


def _loop(conv: Conversation, interactive: bool) -> int:
    interrupted = False  # the last thing at the prompt was a Ctrl-C
    while True:
        try:
            if interactive:
                line = input(">> ")
            else:
                line = sys.stdin.readline()
                if not line:
                    raise EOFError
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            if interrupted:
                return 130
            interrupted = True
            note("Ctrl-C again, Ctrl-D or /exit to quit")
            continue
        interrupted = False
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            if not command(conv, line):
                return 0
            continue
        if line.startswith("//"):
            line = line[1:]
        _turn(conv, line)


def _turn(conv: Conversation, line: str) -> None:
    last, view = None, None
    try:
        with contextlib.closing(conv.reply(line)) as replies:
            for r in replies:
                if last is None:
                    if conv.dropped:
                        note(f"context full: dropped the oldest {conv.dropped} turn(s); the system prompt is kept")
                    view = ReplyView(conv.chat_format, conv.starts_in_reasoning)
                view.feed(r.text)
                last = r
    except TurnTooLong as e:
        note(str(e))
        return
    except KeyboardInterrupt:
        if view is not None:
            view.finish()
        print(flush=True)
        note("reply stopped")
        return
    if view is not None:
        view.finish()
    print(flush=True)
    if last is not None:
        note(f"{last.generation_tokens} tokens; prompt: {last.prompt_tokens} new, {conv.kept} kept; "
             f"TTFT {last.ttft_s:.2f} s, {last.generation_tps:.1f} tok/s")
