"""Text generation without HTTP: sampling, detokenizing, stop strings, chat prompts and Qwen3's
reasoning and tool calls — the one implementation that `run`, `chat` and the server share.

Public names
  SamplingParams   temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
                   repetition_penalty, max_tokens, stop (strings), stop_token_ids, logprobs,
                   top_logprobs; checked at construction: InvalidParam (a ValueError and a
                   pysmoe.InvalidArgument) with `.param` naming the field, message OpenAI-like.
  Sampler          numpy sampler applying SamplingParams to the engine's float32 logits
                   (sampling.py says the pipeline); deterministic given the seed; greedy picks
                   the ids csrc/sample.c picks.
  render_chat      (tokenizer, messages, tools=, chat_template_kwargs=) -> ChatPrompt(ids, text,
                   starts_in_reasoning): OpenAI messages through the vault's chat template.
  Generation       one request's state: sample(logits) -> id, push(id) -> Step; step(logits)
                   does both; finish(reason) ends it early; usage; message() (the final chat
                   message); text (the final completion text).
  Step             token, delta (MessageDelta: content, reasoning, tool_calls), logprobs
                   (TokenLogprob list; .to_openai(tokenizer) gives a logprobs.content entry),
                   finish_reason (None, "stop", "length" or "tool_calls"); chat_delta() gives
                   the OpenAI chunk's `delta` dict, text the completions chunk's text.
  completion_logprobs  (tokenizer, [TokenLogprob], text_offset) -> a /v1/completions choice's
                   legacy logprobs object (tokens, token_logprobs, top_logprobs, text_offset).
  Detokenizer, StopMatcher, Qwen3Parser   the stages, usable alone.
  token_text       (tokenizer, id) -> (text, bytes) as OpenAI's logprobs entries spell a token.

How a server loop uses them (one request; the batcher does this for each in its batch):

    params = SamplingParams(temperature=body.temperature, ..., stop=body.stop)   # 400 on ValueError
    prompt = render_chat(tok, body.messages, tools=body.tools,
                         chat_template_kwargs=body.chat_template_kwargs)
    gen = Generation(tok, params, prompt.ids, chat=True, tools=bool(body.tools),
                     starts_in_reasoning=prompt.starts_in_reasoning,
                     room=session.context - session.position - len(prompt.ids) + 1)
    logits = session.prefill(prompt.ids)          # or its row of a batched step
    while True:
        step = gen.step(logits)                    # sample, detokenize, stop strings, parse
        send(step.chat_delta(), step.logprobs, step.finish_reason)
        if step.finish_reason:
            break
        logits = session.decode(step.token)        # the engine feeds the id just generated
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
  - Logprobs are the model's (log-softmax of the raw logits), not of the sampling distribution.
  - finish_reason "tool_calls" replaces "stop" when the message has tool calls.
"""
from .chat import ChatPrompt, normalize_messages, render_chat, token_bytes, token_text
from .qwen3 import MessageDelta, Qwen3Parser, ToolCallDelta, parse_tool_call
from .request import Generation, Step, TokenLogprob, completion_logprobs
from .sampling import InvalidParam, Sampled, Sampler, SamplingParams, token_logprobs
from .text import Detokenizer, StopMatcher, first_stop

__all__ = ["SamplingParams", "InvalidParam", "Sampler", "Sampled", "token_logprobs", "render_chat", "ChatPrompt",
           "normalize_messages", "token_text", "token_bytes", "Generation", "Step", "TokenLogprob",
           "completion_logprobs", "MessageDelta", "ToolCallDelta", "Qwen3Parser", "parse_tool_call", "Detokenizer",
           "StopMatcher", "first_stop"]
