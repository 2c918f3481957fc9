"""Text generation without HTTP: sampling settings, detokenizing, stop strings, chat prompts and
each family's reasoning and tool calls — the one implementation that `run`, `chat` and the server share.

There is one sampler, the engine's (csrc/engine/sample.c; smoe.h, "sampler"): the session draws
every id, here as in Session.generate, so the same seed and settings give the same ids from
Session.generate, stream_generate, `run`, `chat` and the server. This package says how (the
settings, SamplingParams.sampler_kwargs()) and what the ids mean (text, stops, usage).

Public names
  SamplingParams   temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
                   repetition_penalty, repetition_window, max_tokens, stop (strings),
                   stop_token_ids, logprobs, top_logprobs; checked at construction: InvalidParam
                   (a ValueError and a pysmoe.InvalidArgument) with `.param` naming the field,
                   message OpenAI-like. sampler_kwargs(): Session.set_sampler's arguments (seed
                   None drawn at random and kept; a negative seed as seed % 2**64).
  render_chat      (tokenizer, messages, tools=, chat_template_kwargs=) -> ChatPrompt(ids, text,
                   starts_in_reasoning): OpenAI messages through the vault's chat template.
  Generation       one request's state: push(id, logits=None) -> Step takes the id the engine
                   drew (logits only when params.logprobs: wants_logits); finish(reason) ends it
                   early; usage; message() (the final chat message); text (the final completion
                   text).
  Step             token, delta (MessageDelta: content, reasoning, tool_calls), logprobs
                   (TokenLogprob list; .to_openai(tokenizer) gives a logprobs.content entry),
                   finish_reason (None, "stop", "length" or "tool_calls"); chat_delta() gives
                   the OpenAI chunk's `delta` dict, text the completions chunk's text.
  completion_logprobs  (tokenizer, [TokenLogprob], text_offset) -> a /v1/completions choice's
                   legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset).
  Detokenizer, StopMatcher, Qwen3Parser, HarmonyParser   the stages, usable alone (HarmonyParser:
                   gpt-oss's channels and tool calls).
  FORMATS, format_of, make_parser   the output formats (formats.py): a format's name → its parser
                   class (qwen3, qwen3_coder, glm45, harmony, plain); format_of(model_type, template)
                   picks a vault's; Generation(..., chat_format=name) parses chat replies with it.
  token_text       (tokenizer, id) -> (text, bytes) as OpenAI's logprobs entries spell a token.

How a server loop uses them (one request; the batcher does this for each in its batch):

    params = SamplingParams(temperature=body.temperature, ..., stop=body.stop)   # 400 on ValueError
    prompt = render_chat(tok, body.messages, tools=body.tools,
                         chat_template_kwargs=body.chat_template_kwargs)
    fmt = format_of(vault.config.get("model_type"), tok.chat_template)   # once per vault
    gen = Generation(tok, params, prompt.ids, chat=True, tools=body.tools or [], chat_format=fmt,
                     starts_in_reasoning=prompt.starts_in_reasoning,
                     room=session.context - session.position - len(prompt.ids) + 1)
    session.set_sampler(**params.sampler_kwargs())
    logits, token = session.prefill_next(prompt.ids, want_logits=gen.wants_logits)   # or a batch's row
    while True:
        step = gen.push(token, logits)             # detokenize, stop strings, parse, logprobs
        send(step.chat_delta(), step.logprobs, step.finish_reason)
        if step.finish_reason:
            break
        logits, token = session.decode_next(step.token, want_logits=gen.wants_logits)
    gen.usage                                      # {"prompt_tokens", "completion_tokens", "total_tokens"}
    gen.message()                                  # non-streaming: the whole assistant message

When the client goes away or the context fills, gen.finish("length") (or any reason) flushes
what was held back. A token whose text ended the request (a stop id or stop string) still counts
in usage but is never fed: the session's position is prompt + completion_tokens − 1.
For /v1/completions: Generation(tok, params, ids) (chat False): step.text is the new text.

Semantics worth knowing
  - Stop strings are matched in the model's raw text, before the Qwen3 parser: a stop string can
    end a request inside its reasoning (as vLLM does). Text that might begin a stop string is
    held back; the matched string and everything after it are never sent.
  - A tool call is sent when its `</tool_call>` arrives (two deltas: index/id/type/name, then the
    arguments), not while the model is still writing its JSON: that is what lets malformed JSON
    fall back to content identically whether streamed or not.
  - Logprobs are the model's (log-softmax of the raw logits, pysmoe.logprobs), not of the sampling
    distribution.
  - The repetition penalty looks at the session's history (every id its KV holds, earlier turns
    included); the presence and frequency penalties at the ids drawn since set_sampler.
  - finish_reason "tool_calls" replaces "stop" when the message has tool calls.
"""
from .chat import ChatPrompt, normalize_messages, render_chat, token_bytes, token_text
from .formats import FORMATS, format_of, make_parser
from .harmony import HarmonyParser
from .qwen3 import MessageDelta, Qwen3Parser, ToolCallDelta, parse_tool_call
from .request import Generation, Step, TokenLogprob, completion_logprobs
from .sampling import InvalidParam, SamplingParams
from .text import Detokenizer, StopMatcher, first_stop

__all__ = ["SamplingParams", "InvalidParam", "render_chat", "ChatPrompt", "normalize_messages", "token_text",
           "token_bytes", "Generation", "Step", "TokenLogprob", "completion_logprobs", "MessageDelta", "ToolCallDelta",
           "Qwen3Parser", "HarmonyParser", "parse_tool_call", "Detokenizer", "StopMatcher", "first_stop", "FORMATS",
           "format_of", "make_parser"]
