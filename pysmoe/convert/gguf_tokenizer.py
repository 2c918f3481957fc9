"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as a Hugging Face tokenizer.json that encodes
exactly as llama.cpp does.

llama.cpp's BPE tokenizer (`tokenizer.ggml.model = "gpt2"`) is: split the text at the special
tokens (control tokens only when parsing specials; user-defined ones always), split each piece
with the pre-tokenizer regexes its `tokenizer.ggml.pre` names (src/llama-vocab.cpp), byte-encode
each word GPT-2 style and merge by rank. A tokenizers BPE model with the same vocabulary and
merges, a Split pre-tokenizer per regex (behaviour Isolated: the text between matches is a word
of its own, as llama.cpp keeps it) followed by a ByteLevel pre-tokenizer without its own regex,
and the special tokens as added tokens, is the same function. The regexes below are llama.cpp's
adapted forms (case-insensitive contractions spelled out as classes), not the checkpoints'
originals, so that both engines read the same pattern.

llama.cpp's SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral,
Mixtral) is: split at the special tokens the same way, prefix each remaining piece with a space
(add_space_prefix, on unless the file says otherwise), write spaces as U+2581, then start from the
UTF-8 characters and repeatedly merge the adjacent pair whose concatenation is a token of the
highest score (the leftmost on a tie), and write what is left that is not a token as its
<0xXX> byte tokens. A tokenizers BPE model with byte fallback whose merges are every pair (a, b)
of tokens whose concatenation is a token, ranked by that token's score, with Prepend and Replace
normalizers, is the same function (spm_tokenizer_json).

WordPiece (`bert`), RWKV and UGM vocabularies are refused with a message naming the model, as are
BPE pre-tokenizers not in PRE_TOKENIZERS (one table entry each: llama.cpp's name -> its regexes
and flags).
"""
from __future__ import annotations

import json

# llama.cpp's tokenizer.ggml.pre names -> (regexes in llama.cpp's order, ignore_merges). From
# llama-vocab.cpp's llm_tokenizer_bpe constructor (LLAMA_VOCAB_PRE_TYPE_*) and the name ->
# type table in llama_vocab::impl::load.
_GPT2 = ("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",)
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
          "|\\s+(?!\\S)|\\s+",)
_QWEN35 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",)
_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
           "|\\s+(?!\\S)|\\s+",)
_GPT4O = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
          "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
          "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",)

PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gpt-2": (_GPT2, False),            # also what a byte-level BPE with no pre name means
    "olmo": (_GPT2, False),             # OLMoE
    "qwen2": (_QWEN2, False),           # Qwen2/Qwen3/Qwen3-MoE
    "deepseek-r1-qwen": (_QWEN2, False),
    "qwen35": (_QWEN35, False),         # Qwen3.5 / Qwen3-Next
    "llama-bpe": (_LLAMA3, True),       # Llama 3
    "llama3": (_LLAMA3, True),
    "glm4": (_LLAMA3, False),           # llama.cpp's CHATGLM4: Llama 3's regex with merges kept
    "chatglm-bpe": (_LLAMA3, False),
    "gpt-4o": (_GPT4O, False),          # gpt-oss (o200k)
}

# tokenizer.ggml.token_type values (llama.h's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class TokenizerError(ValueError):
    """The GGUF's vocabulary cannot be expressed as a tokenizer.json that matches llama.cpp."""


def tokenizer_json(meta: dict) -> str:
    """tokenizer.json text for the GGUF metadata meta (key -> Python value, as read)."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("the file has no tokenizer (no tokenizer.ggml.model)")
    if model == "llama":
        return spm_tokenizer_json(meta)
    if model != "gpt2":
        kind = {"llama": "SentencePiece (llama)", "bert": "WordPiece (bert)", "t5": "Unigram (t5)",
                "rwkv": "RWKV", "plamo2": "PLaMo-2"}.get(model, repr(model))
        raise TokenizerError(f"tokenizer.ggml.model {kind}: only byte-level BPE vocabularies (gpt2) "
                             "are converted")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "default":
        pre = "gpt-2"
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"tokenizer.ggml.pre {pre!r} is not known to pysmoe's GGUF import "
                             f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(f"{len(tokens)} tokens but {len(types)} token types")
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # llama.cpp's text -> id map keeps the first of duplicates too
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, USER_DEFINED) and vocab.get(t) == i and t:
            # control tokens are split out only when specials are parsed (HF: special); user-defined
            # ones always (HF: an added token that is not special)
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": ty == CONTROL})
    pre_tokenizers = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
                      for r in regexes]
    pre_tokenizers.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False})
    bos = meta.get("tokenizer.ggml.bos_token_id")
    post = None
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None and 0 <= bos < len(tokens):
        b = tokens[bos]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b: {"id": b, "ids": [bos], "tokens": [b]}}}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }
    return json.dumps(doc, ensure_ascii=False)


def _bos_processor(meta: dict, tokens: list, default: bool):
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token", default) or bos is None or not 0 <= bos < len(tokens):
        return None
    b = tokens[bos]
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b: {"id": b, "ids": [bos], "tokens": [b]}}}


def spm_tokenizer_json(meta: dict) -> str:
    """tokenizer.json for a SentencePiece (`llama`) vocabulary, encoding as llama.cpp's
    llm_tokenizer_spm does (the module's docstring says how)."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * n)
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
    if len(scores) != n or len(types) != n:
        raise TokenizerError(f"{n} tokens but {len(scores)} scores and {len(types)} token types")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise TokenizerError(f"a SentencePiece vocabulary without byte tokens ({', '.join(missing[:3])}... "
                             "missing): llama.cpp's byte fallback cannot be reproduced")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty in (CONTROL, UNKNOWN)}
             for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (CONTROL, USER_DEFINED, UNKNOWN) and vocab.get(t) == i and t]
    # every split of every token into two tokens, ranked by the token's score (ties: its id)
    merges = []
    for t, i in vocab.items():
        if types[i] == BYTE:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], i, k, a, b))
    merges.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]
    if space_prefix:
        normalizers.insert(0, {"type": "Prepend", "prepend": "\u2581"})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": _bos_processor(meta, tokens, default=True),  # llama.cpp's SPM default: add BOS
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": [[a, b] for *_, a, b in merges]},
    }
    return json.dumps(doc, ensure_ascii=False)


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: the chat template and the special tokens' texts."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    out = {"bos_token": text("bos"), "eos_token": text("eos"), "pad_token": text("padding"),
           "unk_token": text("unknown"), "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
           "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    out = {k: v for k, v in out.items() if v is not None}
    if meta.get("tokenizer.chat_template"):
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def generation_config(meta: dict) -> dict:
    """generation_config.json: the ids that end a generation (eos, and eot/eom when set)."""
    eos = []
    for key in ("eos", "eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and i not in eos:
            eos.append(int(i))
    out = {}
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    return out
