"""Tokenizers: the one a vault carries (tokenizer.json, Hugging Face format) and a synthetic one.

`load_tokenizer(vault_dir)` wraps `tokenizers.Tokenizer` with what generation needs: encode,
decode that tolerates ids past the tokenizer's vocabulary (real Qwen models have a larger
embedding table than tokenizer, and a random model happily samples from the gap), the
end-of-sequence ids (generation_config.json's `eos_token_id`, an int or a list — Qwen3 has
several — then tokenizer_config.json's eos_token), and the checkpoint's own chat template
(tokenizer_config.json's `chat_template` or chat_template.jinja) rendered with jinja2 the way
transformers' `apply_chat_template` renders it: a sandboxed environment with trim_blocks and
lstrip_blocks, the loopcontrols extension and a `{% generation %}` block, the `tojson` filter
without HTML escaping, the globals `raise_exception` and `strftime_now`, and the special tokens
(bos_token, eos_token, ...) plus any template keyword arguments (`enable_thinking=False`) as
variables. A vault without a template gets ChatML.

`Tokenizer.min_tokens(text)` is a lower bound on len(encode(text)) computed without encoding
(the server refuses a prompt that cannot fit its context before spending seconds on it).

`build_synthetic_tokenizer(vocab_size)` trains a small byte-level BPE on a corpus shipped in
pysmoe/data/, so that synthetic vaults speak bytes like a real model does.
"""
from __future__ import annotations

import functools
import json
import pathlib

from .errors import InvalidArgument

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_SYNTH_VOCAB = 1000
# 256 byte tokens + the special tokens + a few merges.
MIN_SYNTH_VOCAB = 256 + len(SPECIAL_TOKENS) + 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "corpus.txt"


def build_synthetic_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text of a byte-level BPE with min(vocab_size - 3, 1000) tokens plus the
    three ChatML special tokens (ids right after them, all < vocab_size). Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_SYNTH_VOCAB:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {MIN_SYNTH_VOCAB}, got {vocab_size}")
    target = min(vocab_size - len(SPECIAL_TOKENS), MAX_SYNTH_VOCAB)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = _CORPUS.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size
    return tok.to_str()


def synthetic_tokenizer_config() -> dict:
    """tokenizer_config.json of a synthetic vault."""
    return {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "model_max_length": 131072, "tokenizer_class": "Qwen2Tokenizer"}


def apply_chat_template(messages, add_generation_prompt: bool = True) -> str:
    """ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n` per message, then the assistant's
    opening when add_generation_prompt. messages: dicts with "role" and "content"."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _environment():
    """A jinja2 environment configured as transformers configures the one of apply_chat_template."""
    import datetime
    import json as _json

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        rendering it is rendering its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return _json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_chat_template(template: str, messages, add_generation_prompt: bool = True, tools=None,
                         documents=None, **variables) -> str:
    """The text of a conversation under a jinja chat template, as transformers renders it.
    `reasoning_content`, `thinking` and `reasoning` of a message are aliased to each other as
    transformers does (templates read one or another)."""
    chat = []
    for m in messages:
        m = dict(m)
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        if r is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        chat.append(m)
    return _environment().from_string(template).render(
        messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
        **variables)


class Tokenizer:
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json when
    present) of a vault."""

    def __init__(self, tokenizer_json: str, config: dict | None = None, chat_template: str | None = None,
                 generation_config: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.config = config or {}
        self.generation_config = generation_config or {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = chat_template if chat_template is not None else _template_of(self.config)
        eos = []
        gen = self.generation_config.get("eos_token_id")
        for i in (gen if isinstance(gen, list) else [gen] if gen is not None else []):
            if int(i) not in eos:
                eos.append(int(i))
        for name in (_token_text(self.config.get("eos_token")), "<|im_end|>", "<|endoftext|>"):
            i = self._tok.token_to_id(name) if name else None
            if i is not None and i not in eos:
                eos.append(i)
        self.eos_ids = eos

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def chat_template(self) -> str | None:
        return self._template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of text; special tokens written in the text (`<|im_start|>`) become their ids.
        add_special_tokens: also those the tokenizer's post-processor adds (a BOS, say). Text that
        is not a str, or holds a lone surrogate (which UTF-8 cannot carry), is InvalidArgument."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if not isinstance(text, str):
                raise InvalidArgument(f"text to encode must be a str, not {type(text).__name__}") from None
            bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if bad is None:
                raise
            raise InvalidArgument(f"the text has a lone surrogate (U+{ord(text[bad]):04X}) at character {bad}: "
                                  "it is not valid Unicode") from None

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), from the text's length alone: its bytes (after the
        tokenizer's normaliser) over the most bytes one token can stand for. 0 when the model is not
        a BPE (a WordPiece [UNK] may stand for a whole word)."""
        most = self._max_token_bytes
        if most is None or not isinstance(text, str):
            return 0
        norm = self._tok.normalizer
        if norm is not None:
            text = norm.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // most)

    @functools.cached_property
    def _max_token_bytes(self) -> int | None:
        # A BPE token's piece is at least as long in UTF-8 as the bytes it stands for (byte-level
        # pieces spell each byte as one character of 1 or 2 bytes; a Metaspace '▁' is 3 bytes
        # for one space; an unknown character becomes one [UNK], whose text is longer than 4 bytes
        # or counted here as 4).
        if type(self._tok.model).__name__ != "BPE":
            return None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max(4, max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab), default=0))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ids; ids past the tokenizer's vocabulary decode to ""."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token: int) -> str | None:
        """The vocabulary's spelling of an id (a byte-level piece, not its text), None past it."""
        return self._tok.id_to_token(int(token))

    def to_str(self) -> str:
        """The tokenizer.json text (what a grammar library reads the vocabulary from)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True,
                            tools=None, **template_kwargs):
        """The ids of a conversation under the vault's chat template (its text with
        tokenize=False), as Hugging Face's method of the same name returns them. template_kwargs
        become template variables (Qwen3: enable_thinking=False); tools is a list of JSON
        schemas. Without a template: ChatML."""
        if self._template is None:
            text = apply_chat_template(messages, add_generation_prompt)
        else:
            special = {k: _token_text(self.config[k]) for k in _SPECIAL if self.config.get(k) is not None}
            text = render_chat_template(self._template, messages, add_generation_prompt, tools=tools,
                                        **{**special, **template_kwargs})
        return self.encode(text) if tokenize else text


def _template_of(config: dict) -> str | None:
    t = config.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return t


def _token_text(tok) -> str | None:
    # tokenizer_config.json writes a token either as a string or as {"content": ...}.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def load_tokenizer(vault_dir) -> Tokenizer:
    """The tokenizer of a vault directory (FileNotFoundError if it has no tokenizer.json)."""
    d = pathlib.Path(vault_dir)
    tj = d / "tokenizer.json"
    if not tj.exists():
        raise FileNotFoundError(f"{d} has no tokenizer.json")
    tc = d / "tokenizer_config.json"
    config = json.loads(tc.read_text(encoding="utf-8")) if tc.exists() else {}
    jinja = d / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.exists() else None
    gc = d / "generation_config.json"
    gen = json.loads(gc.read_text(encoding="utf-8")) if gc.exists() else {}
    return Tokenizer(tj.read_text(encoding="utf-8"), config, template, gen)
