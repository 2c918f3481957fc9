"""lm-evaluation-harness against a live `pysmoe serve` on loopback, on tasks written here over a tiny
local dataset (no downloads): `local-completions` scores a multiple-choice task (echo + logprobs,
several prompts per request, the tokenizer read from the server's /tokenize, /tokenizer_info) and
its log-likelihoods equal the engine's own, fed token-serially; `local-chat-completions` runs a
generation task whose answers are the server's chat completions. Skipped where lm_eval is missing."""
from __future__ import annotations

import argparse
import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm_eval[api]: what its API models need
pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

import pysmoe  # noqa: E402
from pysmoe.cli.serve import Background  # noqa: E402
from pysmoe.demo import ensure_demo_vault  # noqa: E402

DOCS = [
    {"question": "The quick brown fox", "choices": [" jumps over the lazy dog", " is a language", " the"],
     "answer": 0},
    {"question": "Python is a programming", "choices": [" language", " fox", " dog jumps"], "answer": 0},
    {"question": "Once upon a time there was", "choices": [" a king", " the quick", " language"], "answer": 0},
    {"question": "The most significant", "choices": [" variance", " brown", " of the the"], "answer": 0},
]

MC_TASK = """task: pysmoe_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""

GEN_TASK = """task: pysmoe_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, monkeypatch_module):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (d / "mc.yaml").write_text(MC_TASK.format(data=data))
    (d / "gen.yaml").write_text(GEN_TASK.format(data=data))
    # no hub: datasets reads the local file, into a cache of its own
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(d / "hf-cache"))
    return d


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def served():
    args = argparse.Namespace(vault=str(ensure_demo_vault()), host="127.0.0.1", port=0, api_key=None,
                              model_name="demo", alias=[], max_batch=4, batching=True, cache_mb=16, kv_mb=None,
                              threads=1, chunk=64, context=512, max_tokens_limit=256, max_request_kb=256,
                              buffered=False, device="cpu", gpu_cache_mb=None)
    bg = Background(args)
    yield bg
    bg.close()


def _evaluate(served, tasks, model: str, task: str, **kw):
    from lm_eval.tasks import TaskManager
    path = "/v1/chat/completions" if "chat" in model else "/v1/completions"
    model_args = {"model": "demo", "base_url": f"http://127.0.0.1:{served.port}{path}", "max_retries": 1,
                  "num_concurrent": 1}
    if "chat" not in model:
        model_args["tokenizer_backend"] = "remote"  # /tokenizer_info, /tokenize, /detokenize of the server
    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # only ours: no indexing of lm-eval's
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=manager,
                                   log_samples=True, verbosity="ERROR", **kw)


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into ids (TemplateLM._encode_pair): the
    context's trailing spaces move to the continuation, whose ids are the whole's after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return ctx, whole[len(ctx):]


def _engine_loglikelihood(vault, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Σ log p(continuation | context) and whether each continuation id is the argmax, from the
    engine fed token-serially (pysmoe.logprobs: log-softmax in double)."""
    ids = ctx + cont
    total, greedy = [], True
    with vault.session(cache_bytes=1 << 24, threads=1, prefill="token-serial", context=512) as s:
        for i, t in enumerate(ids[:-1]):
            logits = s.decode(t)
            if i + 1 >= len(ctx):
                lp, best = pysmoe.logprobs(logits, ids[i + 1], 1)
                total.append(lp)
                greedy = greedy and lp == best[0][1]
    return sum(total), greedy


def test_local_completions_multiple_choice_loglikelihoods_are_the_engines(served, tasks):
    out = _evaluate(served, tasks, "local-completions", "pysmoe_mc", batch_size=3)
    samples = out["samples"]["pysmoe_mc"]
    assert len(samples) == len(DOCS)
    tok, vault = served.vault.tokenizer, served.vault
    scored = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            got_ll, got_greedy = resp[0]
            want_ll, want_greedy = _engine_loglikelihood(vault, *_encode_pair(tok, context, continuation))
            assert math.isfinite(got_ll)
            assert got_ll == want_ll  # the same doubles, summed in the same order
            assert bool(got_greedy) == want_greedy
            scored += 1
    assert scored == sum(len(d["choices"]) for d in DOCS)
    acc = out["results"]["pysmoe_mc"]["acc,none"]
    want_acc = sum(max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) == s["target"]
                   for s in samples) / len(samples)
    assert acc == want_acc


def test_local_chat_completions_generation_is_the_servers_chat(served, tasks):
    import openai
    out = _evaluate(served, tasks, "local-chat-completions", "pysmoe_gen", apply_chat_template=True)
    samples = out["samples"]["pysmoe_gen"]
    assert len(samples) == len(DOCS)
    client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
    for sample in samples:
        question = sample["doc"]["question"]
        want = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}],
                                              max_tokens=8, temperature=0, stop=["\n\n"]).choices[0].message.content
        assert sample["resps"][0][0] == want
