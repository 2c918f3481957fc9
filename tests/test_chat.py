"""python -m pysmoe chat: commands, incremental turns, context trimming, Ctrl-C (on a pty)."""
from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import sys
import time

import pytest

import pysmoe
from pysmoe.cli.chat import Conversation

ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def chat(vault, stdin: str, *args, env=None):
    return subprocess.run([sys.executable, "-m", "pysmoe", "chat", "--vault", str(vault), "--cache-mb", "1", *args],
                          input=stdin, capture_output=True, text=True, timeout=300, env=env or ENV)


def test_commands_are_not_sent_to_the_model(tiny_vault):
    out = chat(tiny_vault, "/help\n/system be brief\n/bogus\n/reset\n/system\n/exit\nnever sent\n", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""  # no reply was generated: every line was a command, and /exit quit
    for text in ("/reset", "system prompt set: be brief", "unknown command /bogus", "conversation cleared",
                 "system prompt removed"):
        assert text in out.stderr


def test_piped_turns_and_eof(tiny_vault):
    out = chat(tiny_vault, "hello\n//slash is text\n", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r"\[3 tokens; prompt", out.stderr)) + out.stderr.count("[1 tokens") >= 2


def _fresh_generate(vault, ids, n):
    with pysmoe.open_vault(vault) as v, v.session(cache_bytes=1 << 20) as s:
        return list(s.generate(ids, max_tokens=n))


def test_each_turn_feeds_only_the_new_tokens(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session(cache_bytes=1 << 20) as s:
        conv = Conversation(s, v.tokenizer, system="you are a test", max_tokens=1)
        list(conv.reply("hello"))            # one token: its reply re-renders to the same ids
        fed = list(conv.fed)
        assert len(fed) == s.position > 0
        conv.max_tokens = 5
        got = [r.token for r in conv.reply("and then?")]
        assert conv.kept == len(fed)         # the first turn's KV was kept, not re-prefilled
        ids = v.tokenizer.apply_chat_template([{"role": "system", "content": "you are a test"},
                                               {"role": "user", "content": "hello"},
                                               conv.turns[1], {"role": "user", "content": "and then?"}])
        assert ids[:len(fed)] == fed
    assert got == _fresh_generate(tiny_vault, ids, 5)  # bit-identical to prefilling it all at once


def test_stopping_a_reply_keeps_the_session_consistent(tiny_vault):
    with pysmoe.open_vault(tiny_vault) as v, v.session(cache_bytes=1 << 20) as s:
        conv = Conversation(s, v.tokenizer, max_tokens=50)
        with contextlib.closing(conv.reply("tell me a story")) as replies:
            for i, _ in enumerate(replies):
                if i == 3:
                    break                    # what the CLI does on Ctrl-C: close the reply
        assert len(conv.fed) == s.position and conv.turns[-1]["role"] == "assistant"
        conv.max_tokens = 4
        got = [r.token for r in conv.reply("go on")]
        ids = v.tokenizer.apply_chat_template(conv.turns[:-1])
    assert got == _fresh_generate(tiny_vault, ids, 4)


def test_a_full_context_drops_the_oldest_turns_but_keeps_the_system_prompt(tiny_vault):
    turns = "".join(f"message number {i} with some words in it\n" for i in range(8))
    out = chat(tiny_vault, turns, "--context", "200", "--max-tokens", "16", "--system", "SYSTEM PROMPT")
    assert out.returncode == 0, out.stderr
    assert "dropped the oldest" in out.stderr and "system prompt is kept" in out.stderr
    assert out.stderr.count("tokens; prompt") == 8  # every turn was answered
    with pysmoe.open_vault(tiny_vault) as v, v.session(context=200, cache_bytes=1 << 20) as s:
        conv = Conversation(s, v.tokenizer, system="SYSTEM PROMPT", max_tokens=16)
        for i in range(8):
            list(conv.reply(f"message number {i} with some words in it"))
            assert conv.messages()[0] == {"role": "system", "content": "SYSTEM PROMPT"}
            assert s.position <= 200
        assert conv.turns[0]["content"] != "message number 0 with some words in it"


def test_a_message_too_long_for_the_context_is_refused(tiny_vault):
    out = chat(tiny_vault, "word " * 400 + "\nshort\n", "--context", "128", "--max-tokens", "8")
    assert out.returncode == 0 and "do not fit the context" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.count("tokens; prompt") == 1  # the short one after it is answered


# ------------------------------------------------------------------------------ on a terminal

class Terminal:
    def __init__(self, argv, env):
        import pty
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its terminal is the pty
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.out, self.seen = b"", 0  # output so far; where the last expect's match ended

    def expect(self, pattern: bytes, timeout=120) -> None:
        """Wait for pattern in the output after the previous match."""
        deadline = time.monotonic() + timeout
        while not (m := re.compile(pattern).search(self.out, self.seen)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen in {self.out[-2000:]!r}")
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"{pattern!r} not seen before exit in {self.out[-2000:]!r}")
                self.out += chunk
        self.seen = m.end()

    def send(self, data: bytes, pace: bool = True) -> None:
        # Typing pace: readline resets the terminal's mode after it shows the prompt, and a byte
        # that arrives in that instant can be discarded (no person types that fast).
        if pace:
            time.sleep(0.3)
        os.write(self.fd, data)

    def wait(self) -> int:
        with contextlib.suppress(OSError):
            while os.read(self.fd, 65536):
                pass
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs a pseudo-terminal")
def test_ctrl_c_on_a_terminal(tiny_vault, tmp_path):
    env = dict(ENV, XDG_STATE_HOME=str(tmp_path), TERM="dumb")
    t = Terminal(["-m", "pysmoe", "chat", "--vault", str(tiny_vault), "--cache-mb", "1", "--max-tokens", "3500",
                  "--context", "4096"], env)
    t.expect(rb">> ")
    t.send(b"tell me everything\r")
    t.expect(rb"tell me everything\r?\n.{8}")  # the reply has started
    t.send(b"\x03", pace=False)               # ... and is far from its 3500 tokens
    t.expect(rb"reply stopped")
    t.expect(rb">> ")
    t.send(b"/system short\r")                # the session still answers after the stop
    t.expect(rb"system prompt set")
    t.expect(rb">> ")
    t.send(b"\x03")
    t.expect(rb"Ctrl-C again")
    t.send(b"\x03")
    assert t.wait() == 130
    assert "/system short" in (tmp_path / "pysmoe" / "history").read_text()


def test_reply_view_shows_reasoning_apart_and_no_call_tags(capsys):
    """A Qwen3 reply: <think> on stderr, the answer on stdout, the call as a note, no tags shown."""
    from pysmoe.cli.chat import ReplyView

    reply = ("<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n"
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    view = ReplyView("qwen3")
    for i in range(0, len(reply), 4):
        view.feed(reply[i:i + 4])
    msg = view.finish()
    out, err = capsys.readouterr()
    assert out.strip() == "Let me look." and "The user wants the weather." in err
    assert '[tool call get_weather({"city": "Paris"})]' in err
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tag not in out and tag not in err
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
