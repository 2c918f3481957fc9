"""Tokenizers: the one a vault carries (tokenizer.json, Hugging Face format) and a synthetic one.

`load_tokenizer(vault_dir)` wraps `tokenizers.Tokenizer` with what generation needs: encode,
decode that tolerates ids past the tokenizer's vocabulary (real Qwen models have a larger
embedding table than tokenizer, and a random model happily samples from the gap), the
end-of-sequence ids, and the ChatML chat template written out in Python (no jinja).

`build_synthetic_tokenizer(vocab_size)` trains a small byte-level BPE on a corpus shipped in
pysmoe/data/, so that synthetic vaults speak bytes like a real model does.
"""
from __future__ import annotations

import json
import pathlib

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


class Tokenizer:
    """tokenizer.json (+ tokenizer_config.json when present) of a vault."""

    def __init__(self, tokenizer_json: str, config: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.config = config or {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = []
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
        return self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        """Ids of text; special tokens written in the text (`<|im_start|>`) become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ids; ids past the tokenizer's vocabulary decode to ""."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        """The ids of a conversation in ChatML (its text with tokenize=False), as Hugging Face's
        method of the same name returns them."""
        text = apply_chat_template(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text


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
    return Tokenizer(tj.read_text(encoding="utf-8"), config)
