"""``epmoe serve`` end to end: a real server process with 2 gloo ranks and the built-in checkpoint, driven
by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid

import httpx
import openai
import pytest

import epmoe
from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.runtime.launch import free_port
from epmoe.server.ranks import STEP_KINDS
from epmoe.server.text import TextCodec
from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.multiprocess

PROMPTS = ["Expert parallelism places whole experts on ranks", "The quick brown fox", "def all_to_all(x):",
           "Mixture of experts"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--ep", "2")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    """Greedy outputs of the engine alone (one process, no server): prompt -> final RequestOutput."""
    engine = Engine(EngineConfig(model=str(ensure_default_checkpoint())))
    cache: dict[tuple[str, int, str], object] = {}

    def run(prompts: list[str], max_tokens: int, **options) -> list:
        key = repr(sorted(options.items()))
        todo = [p for p in prompts if (p, max_tokens, key) not in cache]
        if todo:
            outs = engine.generate(todo, SamplingParams(temperature=0, max_tokens=max_tokens, **options))
            cache.update({(p, max_tokens, key): o for p, o in zip(todo, outs)})
        return [cache[(p, max_tokens, key)] for p in prompts]

    return run


def wait_kv_free(server, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metric("epmoe:kv_blocks_used") == 0 and server.metric("epmoe:num_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"KV blocks still used after {timeout_s} s: {server.metric('epmoe:kv_blocks_used')}")


def test_models_and_health(server, client):
    # started with --port 0 (conftest): the log names the port bound, where the server answers; the model and ready
    # lines are written before /health turns ready (the conftest waited for it), so they are there already
    log = server.log.read_text()
    assert server.port > 0 and f"listening on {server.url} " in log and f"ready: {server.url}/v1" in log, log
    assert "expert backend reference, routed experts held as float32" in log, log  # built-in model, CPU float32
    assert httpx.get(f"{server.url}/health").json() == {"status": "ready"}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 256
    assert client.models.retrieve(MODEL).id == MODEL  # OpenAI's GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="model 'other/model' does not exist; this server serves"):
        client.models.retrieve("other/model")
    empty = httpx.get(f"{server.url}/v1/models/", headers=AUTH, timeout=30)  # was the served model's card, 200
    assert empty.status_code == 404 and empty.json()["error"]["param"] == "model", empty.text
    # vLLM's /ping (GET and POST) and /version; CORS answers for any origin by default (vLLM's)
    assert httpx.get(f"{server.url}/ping").json() == httpx.post(f"{server.url}/ping").json() == {"status": "ready"}
    assert httpx.get(f"{server.url}/version").json() == {"version": epmoe.__version__}
    put = httpx.put(f"{server.url}/ping")
    assert put.status_code == 405
    assert put.json()["error"]["message"] == "method PUT is not allowed on /ping (use GET, POST)"
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"


def test_greedy_completions_equal_engine_offline(client, offline):
    ref = offline(PROMPTS, 12)
    for prompt, out in zip(PROMPTS, ref):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == out.text
        assert got.choices[0].finish_reason == out.finish_reason
        assert got.usage.completion_tokens == len(out.token_ids)
        assert got.usage.prompt_tokens == len(prompt.encode())
    # a list of prompts: one choice each, in order
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [o.text for o in ref]
    assert [c.index for c in got.choices] == [0, 1, 2, 3]


def test_streaming_equals_whole(client, server, offline):
    ref = offline(PROMPTS[:1], 12)[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 12
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "stream": True}
    raw = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    # the default template: "<|system|>\nbe brief\n<|user|>\nHello there\n<|assistant|>\n" in bytes
    assert whole.usage.prompt_tokens == len("<|system|>\nbe brief\n<|user|>\nHello there\n<|assistant|>\n")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_of_completions_whole_and_streamed(client, offline):
    ref = offline(PROMPTS[:1], 6, logprobs=2)[0]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    text_of = TextCodec(str(ensure_default_checkpoint()), 259).token_text  # the checkpoint's tokenizer, one token
    assert lp.tokens == [text_of(t) for t in ref.token_ids] and "".join(lp.tokens) == whole.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, top, e in zip(lp.tokens, lp.top_logprobs, ref.logprobs):
        assert top == pytest.approx({text_of(i): v for i, v in e.top}, abs=1e-4)  # greedy: the token is the top one
        assert max(top.values()) == top[token]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum(len(s.tokens) for s in streamed) == 6
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert all(c.choices[0].logprobs is None
               for c in client.completions.create(stream=True, **{**kw, "logprobs": None}))


def test_echo_with_logprobs_as_lm_eval_asks(client, offline):
    # lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1, greedy
    prompt = [ord(ch) for ch in PROMPTS[1]]
    ref = offline(PROMPTS[1:2], 1, logprobs=1, prompt_logprobs=1)[0]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    assert whole.text == PROMPTS[1] + ref.text
    lp = whole.logprobs
    n = len(prompt)
    assert lp.tokens == [chr(t) for t in prompt] + [ref.text] and lp.text_offset == list(range(n + 1))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:] + ref.logprobs],
                                                  abs=1e-4)
    for token, top, e in zip(lp.tokens[1:], lp.top_logprobs[1:], ref.prompt_logprobs[1:] + ref.logprobs):
        assert len(top) in (1, 2) and top[token] == pytest.approx(e.logprob, abs=1e-4)  # the top one and the token
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert chunks[0].text == PROMPTS[1] and "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    only = client.completions.create(**{**kw, "max_tokens": 0})  # vLLM's: the prompt alone
    assert only.choices[0].text == PROMPTS[1] and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.tokens == lp.tokens[:n] and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **{**kw, "max_tokens": 0})]
    assert "".join(c.text for c in chunks) == PROMPTS[1] and chunks[-1].finish_reason == "length"
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == PROMPTS[1] + offline(PROMPTS[1:2], 3)[0].text and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 3


def test_logprobs_name_tokens_by_id_and_offsets_point_into_the_text(client):
    # bytes >= 128 all read "\ufffd" alone: their map keys collide, so the map keeps each text's most likely value;
    # return_tokens_as_token_ids names every token apart (vLLM's)
    kw = dict(model=MODEL, prompt="Expert parallelism", max_tokens=8, temperature=0, logprobs=3)
    lp = client.completions.create(**kw).choices[0].logprobs
    assert all(top[t] >= v for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    by_id = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(t.startswith("token_id:") for t in by_id.tokens) and by_id.token_logprobs == lp.token_logprobs
    assert all(len(top) in (3, 4) and top[t] == v for t, v, top in zip(by_id.tokens, by_id.token_logprobs,
                                                                         by_id.top_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
    # an echoed token-id prompt with a special token: decoded with it, every offset inside the text, in order
    echo = client.completions.create(model=MODEL, prompt=[256, 72, 105, 32, 116, 104, 101, 114, 101], max_tokens=2,
                                     temperature=0, logprobs=1, echo=True).choices[0]
    assert echo.text.startswith("<s>Hi there")
    offsets = echo.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] <= len(echo.text)
    assert [echo.text[o:o + len(t)] for o, t in zip(offsets[:9], echo.logprobs.tokens[:9])] == \
        echo.logprobs.tokens[:9]


def test_prompt_logprobs_as_vllm_returns_them(server, offline):
    ref = offline(PROMPTS[2:3], 2, prompt_logprobs=2)[0]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    got = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]
    entries = got["prompt_logprobs"]
    assert len(entries) == len(ref.prompt_token_ids) and entries[0] is None and got["logprobs"] is None
    for entry, want, token in zip(entries[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-4) and mine["rank"] == want.rank
        assert mine["decoded_token"] == chr(token)  # the built-in tokenizer's tokens are bytes
        ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] <= 2)
        assert [i for _, i in ranked] == [i for i, _ in want.top] and len(entry) in (2, 3)
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_tokenize_and_detokenize_as_vllm(server, client):
    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}{route}", json={"model": MODEL, **body}, headers=AUTH, timeout=30)

    got = post("/tokenize", {"prompt": "hi!"}).json()
    assert got == {"count": 3, "max_model_len": 256, "tokens": [104, 105, 33]}
    messages = [{"role": "user", "content": "Hello there"}]
    chat = post("/tokenize", {"messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens == len(chat["tokens"])  # what a chat request feeds
    text = post("/detokenize", {"tokens": chat["tokens"]}).json()
    assert text == {"prompt": "<|user|>\nHello there\n<|assistant|>\n"}
    assert post("/detokenize", {"tokens": [256, 104]}).json() == {"prompt": "<s>h"}  # special tokens kept
    bad = [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
           ("/detokenize", {"tokens": [999]}, "tokens"), ("/detokenize", {"tokens": "a"}, "tokens")]
    for route, body, param in bad:
        r = post(route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "a"}).status_code == 401
    assert post("/tokenize", {"model": "other", "prompt": "a"}).status_code == 404
    # as vLLM, ``model`` may be left out (or null); one sent must be the served one
    cases = [("/tokenize", {"prompt": "hi!"}, got), ("/detokenize", {"tokens": [256, 104]}, {"prompt": "<s>h"})]
    for route, body, want in cases:
        for model in ({}, {"model": None}):
            r = httpx.post(f"{server.url}{route}", json={**model, **body}, headers=AUTH, timeout=30)
            assert r.status_code == 200 and r.json() == want, r.text
        other = httpx.post(f"{server.url}{route}", json={"model": "other", **body}, headers=AUTH, timeout=30)
        assert other.status_code == 404 and other.json()["error"]["param"] == "model", other.text
        assert "'other'" in other.json()["error"]["message"]
        wrong = httpx.post(f"{server.url}{route}", json={"model": 3, **body}, headers=AUTH, timeout=30)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model", wrong.text
        assert "(got 3)" in wrong.json()["error"]["message"]


def test_logprobs_of_chat_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5, temperature=0,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert "".join(c.token for c in content) == whole.message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode())
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob) and c.logprob <= 0
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    streamed = [e for ch in client.chat.completions.create(stream=True, **kw) if ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [c.model_dump() for c in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": True, "top_logprobs": None}).choices[0]
    assert [(c.token, c.logprob, c.top_logprobs) for c in plain.logprobs.content] == \
        [(c.token, c.logprob, []) for c in content]
    assert client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": 0}).choices[0].logprobs is None


def test_penalties_min_p_and_logit_bias_equal_the_engine_offline(client, offline):
    options = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05)
    ref = offline(PROMPTS[3:4], 10, ignore_eos=True, **options)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05},
                                    presence_penalty=1.5, frequency_penalty=0.5)
    assert got.choices[0].text == ref.text
    assert ref.token_ids != offline(PROMPTS[3:4], 10, ignore_eos=True)[0].token_ids  # the penalties changed it
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == "*" * 5  # token 42 is the byte "*"


def test_generation_config_chat_template_and_prefix_caching_flags(start_server, offline, tmp_path, capsys):
    # --generation-config DIR: requests without temperature take its 0 (greedy); --chat-template inline;
    # prefix caching (on by default): a repeated prompt's full blocks come from the cache
    (tmp_path / "generation_config.json").write_text('{"temperature": 0, "max_new_tokens": 4}')
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    spec = start_server("--ep", "1", "--generation-config", str(tmp_path), "--chat-template", template,
                        "--allowed-origins", '["http://ui.example"]', "--allow-credentials")
    client = openai.OpenAI(base_url=f"{spec.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    # CORS for the one origin given, with credentials; another origin's preflight is refused
    asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{spec.url}/v1/completions", headers={"Origin": "http://ui.example", **asks})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ui.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    refused = httpx.options(f"{spec.url}/v1/completions", headers={"Origin": "http://elsewhere.example", **asks})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    for _ in range(2):  # the second time from the prefix cache (16-token blocks: the prompt's first 32 tokens)
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
        assert got.choices[0].text == offline(PROMPTS[:1], 8)[0].text
    assert spec.metric("epmoe:prefix_cache_hits_total") == 32
    assert spec.metric("epmoe:prefix_cache_queries_total") == 2 * len(PROMPTS[0])
    assert "prefix caching on" in spec.log.read_text()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}])
    assert chat.usage.prompt_tokens == len("<user>hey") and chat.usage.completion_tokens == 4
    assert "sampling defaults of requests that leave them out" in spec.log.read_text()
    from epmoe.cli import main  # a template that does not parse: refused before anything starts, exit 2

    assert main(["serve", "--ep", "1", "--port", "0", "--chat-template", "{% if %}"]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_cached_tokens_are_the_prompt_tokens_served_from_the_prefix_cache(server, client):
    """``usage.prompt_tokens_details.cached_tokens`` (completions and chats, whole and streamed) and the Responses
    API's ``input_tokens_details.cached_tokens``: the prompt's tokens the engine took from its prefix cache (was
    absent, and 0 on /v1/responses). A prompt sent again is served its full blocks as far as the block before its
    last token (always fed: its logits sample the next); each prompt is counted once, as in ``prompt_tokens``."""
    block = int(re.search(r"KV cache per rank: \d+ blocks of (\d+) tokens", server.log.read_text())[1])

    def served(prompt_tokens: int) -> int:
        """The cached tokens of a prompt of ``prompt_tokens`` sent again: its full blocks before its last token."""
        return (prompt_tokens - 1) // block * block

    def unique(blocks: int) -> str:
        """A prompt over ``blocks`` blocks long (one byte a token) whose first block no earlier prompt shares."""
        return uuid.uuid4().hex + " experts" * (blocks * block // 8) + "!"

    prompt, other = unique(3), unique(2)
    assert len(prompt.encode()) % block and served(len(prompt.encode())) >= 3 * block  # a partial last block too
    first, again = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == len(prompt.encode())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == served(len(prompt.encode()))
    assert again.usage.completion_tokens_details is None  # as vLLM's completions (no reasoning is read)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == served(len(prompt.encode()))
    # two prompts, two choices each, twice: the second time every choice is served from its rank's cache (the
    # server's hits), and each prompt counts once (its first choice's), as prompt_tokens does
    client.completions.create(model=MODEL, prompt=[prompt, other], n=2, max_tokens=2)
    hits = server.metric("epmoe:prefix_cache_hits_total")
    batch = client.completions.create(model=MODEL, prompt=[prompt, other], n=2, max_tokens=2)
    each = served(len(prompt.encode())) + served(len(other.encode()))
    assert server.metric("epmoe:prefix_cache_hits_total") - hits == 2 * each
    assert batch.usage.prompt_tokens == len(prompt.encode()) + len(other.encode())
    assert batch.usage.prompt_tokens_details.cached_tokens == each
    messages = [{"role": "user", "content": unique(3)}]
    first, again = (client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == served(again.usage.prompt_tokens) >= 3 * block
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == served(again.usage.prompt_tokens)
    text = unique(3)
    first, again = (client.responses.create(model=MODEL, input=text, max_output_tokens=2) for _ in range(2))
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens == served(again.usage.input_tokens) >= 3 * block
    events = list(client.responses.create(model=MODEL, input=text, max_output_tokens=2, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")  # max_output_tokens may end it
    assert events[-1].response.usage.input_tokens_details.cached_tokens == served(again.usage.input_tokens)


def test_stop_string_cuts_the_text(client, offline):
    text = offline(PROMPTS[1:2], 12)[0].text
    stop = text[4:6]
    cut = text[: text.find(stop)]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seeds_reproducible_and_n(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    several = client.completions.create(seed=7, n=3, **kw)
    texts = [c.text for c in several.choices]
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert texts[0] == a  # choice j samples with seed + j
    assert len(set(texts)) == 3
    assert several.usage.completion_tokens == 30
    unseeded = {client.completions.create(**kw).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1


def test_null_fields_mean_their_defaults_and_neutral_values_pass(client):
    # the openai client sends None as null; null is the field's default, and the unserved fields at their neutral
    # values change nothing
    base = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, seed=3).choices[0].text
    nulls = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, seed=3, temperature=None,
                                      top_p=None, n=None, stream=None, frequency_penalty=0, logprobs=None,
                                      extra_body={"top_k": None, "min_tokens": None, "ignore_eos": None,
                                                  "repetition_penalty": 1.0})
    assert nulls.choices[0].text == base and len(nulls.choices) == 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=None, logprobs=False, response_format={"type": "text"})
    assert chat.usage.completion_tokens == 3


def test_concurrent_streams_each_equal_alone(server, offline):
    prompts = [f"request {i}: {PROMPTS[i % 4]}" for i in range(100)]
    ref = offline(prompts, 8)
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(asyncio.wait_for(run_all(), 90))
    assert texts == [o.text for o in ref]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for i in (0, 37, 99):  # the same request sent alone
        alone = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0)
        assert alone.choices[0].text == texts[i]
    wait_kv_free(server)
    assert server.metric("epmoe:kv_blocks_free") == 2 * 4096
    assert server.metric("epmoe:time_to_first_token_seconds_count") >= 100


BAD = [
    ("malformed json", b'{"model": "x", "prompt": ', 400, None),
    ("empty body", b"", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("token id past the vocabulary", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ("prompt over the context", {"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a million", {"model": MODEL, "prompt": "hi", "max_tokens": 1000000}, 400, "max_tokens"),
    ("max_tokens a string", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature -1", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top_p 2", {"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("top_k -5", {"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("n 1000", {"model": MODEL, "prompt": "hi", "n": 1000}, 400, "n"),
    ("seed negative", {"model": MODEL, "prompt": "hi", "seed": -1}, 400, "seed"),
    ("stop wrong type", {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop"),
    ("stream a string", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("stop token id past the vocabulary", {"model": MODEL, "prompt": "hi", "stop_token_ids": [999999]}, 400,
     "stop_token_ids"),
    ("logprobs 21", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("prompt_logprobs 21", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("echo a string", {"model": MODEL, "prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("bad_words, not served", {"model": MODEL, "prompt": "hi", "bad_words": ["C"]}, 400, "bad_words"),
    ("include_stop_str_in_output, not served", {"model": MODEL, "prompt": "hi", "stop": ["C"],
                                                "include_stop_str_in_output": True}, 400, "include_stop_str_in_output"),
    ("frequency_penalty 5", {"model": MODEL, "prompt": "hi", "frequency_penalty": 5}, 400, "frequency_penalty"),
    ("repetition_penalty 0", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_p 2", {"model": MODEL, "prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("logit_bias key not a token id", {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias key past the vocabulary", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, 400,
     "logit_bias"),
    ("logit_bias value 200", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("unknown model", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("JSON nested too deeply", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("a number of 5000 digits", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, None),
    ("prompt a lone surrogate", b'{"model": "%s", "prompt": "ok \\ud800"}' % MODEL.encode(), 400, "prompt"),
    ("guided_json not an object", {"model": MODEL, "prompt": "hi", "guided_json": "5"}, 400, "guided_json"),
    ("guided_regex a lone surrogate", b'{"model": "%s", "prompt": "hi", "guided_regex": "a\\ud800"}' % MODEL.encode(),
     400, "guided_regex"),
    ("guided_choice of 300,000 strings", {"model": MODEL, "prompt": "hi", "guided_choice": [f"choice-{i}" for i in
                                                                                          range(300_000)]}, 400,
     "guided_choice"),
]
BAD_CHAT = [
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("content a number", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("user message without content", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("max_completion_tokens 0", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("top_logprobs 21", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                         "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "top_logprobs": 2}, 400, "top_logprobs"),
    ("logprobs a number", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, 400,
     "logprobs"),
    ("echo, not served on chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True},
     400, "echo"),
    ("json_schema without its schema", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("response_format type xml", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("a schema that does not compile", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": {"type": "objec"}}}}, 400, "response_format"),
    ("a regex that does not compile", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "structured_outputs": {"regex": "([a"}}, 400, "structured_outputs"),
    ("two constraints", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, "guided_regex"),
    ("a structured_outputs key not served", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "structured_outputs": {"structural_tag": "x"}}, 400,
     "structured_outputs.structural_tag"),
    ("content a lone surrogate", b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc80"}]}'
     % MODEL.encode(), 400, "messages.0.content"),
    # OpenAI's audio output and web search: text without a word before
    ("audio asked", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
                     "audio": {"voice": "alloy", "format": "wav"}}, 400, "modalities"),
    ("web search asked", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "web_search_options": {}},
     400, "web_search_options"),
]


@pytest.mark.parametrize("route, case, body, status, param",
                         [("/v1/completions", *c) for c in BAD] + [("/v1/chat/completions", *c) for c in BAD_CHAT],
                         ids=[c[0] for c in BAD] + [f"chat {c[0]}" for c in BAD_CHAT])
def test_bad_request_answered_and_server_still_serves(server, route, case, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{route}", content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"] or status == 404
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                          "ignore_eos": True}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("route, body, param, message", [
    # a content list that got past the str member: the part is named, not the str member's "a valid string"
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text", "messages.0.content.0.text: Input should be a valid string (got 5)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text' (got 'image_url')"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content", "messages.0.content: must be str | list[ContentPart] (got 5)"),
    # several members failed inside: every member named (it was "Input should be a valid string (got [1.5])")
    ("/v1/completions", {"prompt": [1.5]},
     "prompt", "prompt: must be str | list[int] | list[str] | list[list[int]] (got [1.5])"),
])
def test_a_union_field_error_names_what_failed(server, route, body, param, message):
    r = httpx.post(f"{server.url}{route}", json={"model": MODEL, "max_tokens": 2, **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == message
    ok = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={
        "model": MODEL, "max_tokens": 2, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("route, body, param, message", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens",
     "max_tokens must be an integer >= 1 (0 only with echo), got 0"),
    # chat has no echo: the note was there too
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", "max_completion_tokens must be an integer >= 1, got 0"),
])
def test_a_token_limit_of_zero_names_echo_where_it_exists(server, route, body, param, message):
    r = httpx.post(f"{server.url}{route}", json={"model": MODEL, **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == message


def test_structured_outputs_hold_on_both_endpoints(client, offline):
    """OpenAI's response_format (a schema of an enum: a JSON string), vLLM's structured_outputs (a JSON object without
    free whitespace, streamed too) and guided_choice: each output holds to its constraint, and a constrained request
    gives the offline engine's text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "size", "schema": {"enum": ["small", "large"]}}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "size?"}], max_tokens=20,
                                          temperature=0, response_format=fmt)
    assert json.loads(chat.choices[0].message.content) in ("small", "large")
    assert chat.choices[0].finish_reason == "stop"
    schema = {"type": "object", "required": ["name"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 4}}}
    so = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, extra_body=so)
    text = got.choices[0].text
    assert set(json.loads(text)) == {"name"} and len(json.loads(text)["name"]) <= 4
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                         extra_body=so, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    assert text == offline(PROMPTS[:1], 40, structured_outputs=so["structured_outputs"])[0].text
    picks = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, n=3, seed=4,
                                      extra_body={"guided_choice": ["ant", "bee", "cat"]})
    assert all(c.text in ("ant", "bee", "cat") and c.finish_reason == "stop" for c in picks.choices)


def test_a_long_prompt_whose_client_left_is_not_tokenized(server):
    """Three long prompts whose clients give up after 0.3 s: the first is being tokenized by then, the two queued
    behind it are skipped when their turn comes (the server logs each), and the server serves on."""
    body = {"model": MODEL, "prompt": "ab " * 1_300_000, "max_tokens": 1}
    before = server.log.read_text().count("was tokenized: skipped")
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 120
    while server.log.read_text().count("was tokenized: skipped") < before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.log.read_text().count("was tokenized: skipped") == before + 2, server.log.read_text()[-2000:]
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_model_left_out_is_the_served_one(server):
    """As vLLM: a request without ``model`` or with an empty one is served by the one model, named in the answer;
    another name is a 404."""
    routes = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/responses": {"input": "hi", "max_output_tokens": 2}}
    for route, body in routes.items():
        r = httpx.post(f"{server.url}{route}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL, (route, r.text)
        r = httpx.post(f"{server.url}{route}", json={**body, "model": ""}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL, (route, r.text)  # the openai client's way
        r = httpx.post(f"{server.url}{route}", json={**body, "model": "other"}, headers=AUTH, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", (route, r.text)


def test_auth_routes_and_body_limit(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{server.url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"] == ("method GET is not allowed on /v1/completions "
                                                                     "(use POST)")
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (50 << 20), headers=AUTH, timeout=60)
    assert r.status_code == 413 and "8388608" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 200


def test_a_long_text_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt of a few MB of text takes seconds to tokenize; ``/health`` and a short prompt sent meanwhile are
    answered first (they waited for the long prompt's 400 while the server tokenized on its event loop)."""
    body = {"model": MODEL, "prompt": "ab " * 1_300_000, "max_tokens": 1}
    done: dict[str, tuple[float, httpx.Response]] = {}

    def send() -> None:
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)
        done["long"] = (time.monotonic(), r)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # the body is in and its tokenizing under way
    health = httpx.get(f"{server.url}/health", timeout=120)
    health_done = time.monotonic()
    short = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers=AUTH, timeout=120)  # a short prompt is not queued behind the long one
    short_done = time.monotonic()
    sender.join(120)
    assert health.status_code == 200 and short.status_code == 200
    long_done, r = done["long"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert health_done < long_done, f"/health answered {health_done - long_done:.2f} s after the long prompt"
    assert short_done < long_done, f"the short prompt answered {short_done - long_done:.2f} s after the long one"


def test_dropped_streams_free_their_blocks(server):
    before = server.metric('epmoe:request_success_total{finished_reason="abort"}') if "abort" in httpx.get(
        f"{server.url}/metrics").text else 0.0
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        for _ in range(20):
            with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
                first = next(r.iter_lines())
                assert first.startswith("data: {")
    wait_kv_free(server)
    after = server.metric('epmoe:request_success_total{finished_reason="abort"}')
    assert after - before == 20


def test_eplb_loads_in_the_balance_format(server, tmp_path):
    done = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": "loads", "max_tokens": 2})  # routed tokens, whatever ran before
    assert done.status_code == 200, done.text
    r = httpx.get(f"{server.url}/eplb/loads", headers=AUTH)
    assert r.status_code == 200
    doc = r.json()
    assert doc["format"] == "epmoe.loads/1"
    assert len(doc["load"]) == 2 and len(doc["load"][0]) == 16  # 2 MoE layers, 16 experts
    assert sum(doc["load"][0]) > 0 and sum(doc["load"][0]) % 4 == 0  # top-4 routing
    from epmoe.loads import read_loads

    path = tmp_path / "loads.json"
    path.write_text(json.dumps(doc))
    assert read_loads(path).shape == (2, 16)


def test_bench_serve_against_the_server(server, capsys):
    from epmoe.cli import main

    code = main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "12",
                 "--random-input-len", "16", "--random-output-len", "5", "--max-concurrency", "4", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == MODEL and report["completed"] == 12 and report["failed"] == 0
    assert report["total_input_tokens"] == 12 * 16 and report["total_output_tokens"] == 12 * 5
    assert 0 < report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert report["tpot_ms"]["mean"] > 0 and report["itl_ms"]["mean"] > 0
    assert report["output_throughput"] == pytest.approx(60 / report["duration_s"])
    wait_kv_free(server)


def test_bench_serve_without_the_key_says_so(server, capsys):
    # was "HTTPStatusError: Client error '401 Unauthorized'", blamed on --base-url alone
    from epmoe.cli import main

    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1"]) == 2
    assert (f"--base-url {server.url}: the server answered 401 Unauthorized to GET {server.url}/v1/models (pass the "
            f"server's key with --api-key)") in capsys.readouterr().err
    # also with --model given (it sent every request, each failing with 401, and printed a table of zeros)
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--model", MODEL]) == 2
    assert "the server answered 401 Unauthorized to GET" in capsys.readouterr().err


def test_bench_of_a_model_the_server_does_not_list_is_refused(server, capsys):
    """It sent every request, each answered 404."""
    from epmoe.cli import main

    assert main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--model", "nosuch",
                 "--num-prompts", "2"]) == 2
    assert (f"model 'nosuch' is not served at {server.url}: its /v1/models lists ['{MODEL}']"
            in capsys.readouterr().err)


def test_bench_where_nothing_completed_measures_nothing(server, tmp_path, capsys):
    """Every request refused (a dataset's max_tokens past the 256-token context): the latencies are not measured, not
    zero. Random requests past the context are refused before any is sent, as /v1/models lists the context (it sent
    them all, each answered 400)."""
    from epmoe.cli import main

    assert main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--model", MODEL,
                 "--num-prompts", "2", "--random-input-len", "300", "--random-output-len", "1"]) == 2
    assert (f"epmoe bench: error: --random-prefix-len (0) + --random-input-len (300) + --random-output-len (1) is "
            f"301 tokens a request, past the max_model_len (256) of model '{MODEL}' at {server.url}: the server would "
            f"refuse every request") in capsys.readouterr().err
    data = tmp_path / "long.jsonl"
    data.write_text('{"prompt": "hi", "max_tokens": 200}\n{"prompt": "hi"}\n')  # the second asks 256: no room
    assert main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--model", MODEL,
                 "--num-prompts", "2", "--dataset", str(data), "--random-output-len", "256"]) == 2
    assert (f"--dataset {str(data)!r} asks 256 tokens of a request (a line's max_tokens, or --random-output-len "
            f"where a line has none), which leaves no room for its prompt in the max_model_len (256)"
            in capsys.readouterr().err)
    data.write_text("{\"prompt\": \"" + "hello " * 300 + "\", \"max_tokens\": 8}\n")  # the server judges the text
    assert main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--model", MODEL,
                 "--num-prompts", "2", "--dataset", str(data)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"completed / failed\s+│\s+0 / 2", out), out
    assert re.search(r"TTFT mean / p50 / p99 \(ms\)\s+│\s+- / - / -", out), out
    assert re.search(r"first failure\s+│\s+HTTP 400", out), out


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:99999", r"base_url 'http://127\.0\.0\.1:99999' is not a URL \(Port out of range 0-65535\)"),
    ("http://[::1", r"base_url 'http://\[::1' is not a URL \(Invalid IPv6 URL\)"),
    ("http://:80", r"base_url 'http://:80' names no host"),
])
def test_bench_bad_urls_named(url, message):  # were tracebacks from the connection
    from epmoe.server.bench import BenchConfig

    with pytest.raises(ValueError, match=message):
        BenchConfig(url)


def test_bench_dataset_path_errors_say_what_is_there(tmp_path, capsys):
    """A missing dataset, a directory and a pipe were all "is not a file"; a pipe is now refused before a read that
    would block."""
    import os

    from epmoe.cli import main

    pipe = tmp_path / "fifo.jsonl"
    os.mkfifo(pipe)
    for path, what in ((tmp_path / "none.jsonl", "does not exist"), (tmp_path, "is a directory, not a file"),
                       (pipe, "is not a regular file")):
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(path)]) == 2
        assert f"--dataset '{path}' {what}" in capsys.readouterr().err


def test_bench_dataset_lines_are_json_lines(tmp_path):
    """A prompt holding U+2028 (json.dumps with ensure_ascii=False writes it as is) was split off as a line of its
    own: "line 2: not JSON"."""
    from epmoe.server.bench import BenchConfig, load_requests

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\u0085c"}, ensure_ascii=False) + "\n" + '{"prompt": "x"}\n',
                    encoding="utf-8")
    rows = load_requests(BenchConfig("http://x", dataset=str(path), num_prompts=2))
    assert [r[0] for r in rows] == ["a\u2028b\u0085c", "x"]


def test_bench_random_prompt_flags_are_refused_with_a_dataset(tmp_path, capsys):  # were ignored
    from epmoe.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    for flag in ("--random-input-len", "--random-prefix-len"):
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(data), flag, "5"]) == 2
        assert f"{flag} shapes random prompts; with --dataset the prompts are the file's" in capsys.readouterr().err


def test_bench_seed_range_is_runs(capsys):
    """--seed -1 was taken by bench serve while run and the server refuse it."""
    from epmoe.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--seed", "-1"]) == 2
    assert "--seed must be an integer in [0, 2**63), got -1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "10000000000000"], "--num-prompts must be at most 1,000,000, got 10,000,000,000,000"),
    (["--num-prompts", "1", "--random-input-len", "1000000000"],
     "--random-input-len must be at most 16,777,216 tokens (past any model's context), got 1,000,000,000"),
    (["--num-prompts", "100000", "--random-input-len", "1000"],
     "--num-prompts (100,000) random prompts of --random-prefix-len + --random-input-len (1,000) tokens are "
     "100,000,000 tokens, past the 67,108,864 a run makes before it sends the first"),
])
def test_bench_sizes_that_would_fill_memory_are_refused(capsys, flags, message):
    """They made every prompt before sending one: no output, memory growing, until killed."""
    from epmoe.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_without_a_server_is_one_error_with_or_without_model(capsys):
    """With --model it skipped the model list and reported a table of failed requests (exit 1)."""
    from epmoe.cli import main

    for model in ([], ["--model", "foo"]):
        assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                     *model]) == 2
        assert "ConnectError" in capsys.readouterr().err


def test_bench_rate_that_would_wait_days_is_refused(capsys):
    """--request-rate 1e-4 spread 100 arrivals over 11 days and waited silently."""
    from epmoe.cli import main

    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1e-4"]) == 2
    assert ("--request-rate 0.0001 spreads 100 prompts over 990000 s, past the 86400 s (one day)"
            in capsys.readouterr().err)
    from epmoe.server.bench import BenchConfig

    assert BenchConfig("http://127.0.0.1:9", num_prompts=1, request_rate=1e-4).request_rate == 1e-4  # one arrival
    assert BenchConfig("http://127.0.0.1:9", num_prompts=9, request_rate=1e-4).num_prompts == 9  # 8e4 s: a day holds it


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hi", "max_tokens": 1e400}', "field 'max_tokens' must be an integer >= 1, got inf"),
    ('{"prompt": "hi", "max_tokens": "abc"}', "field 'max_tokens' must be an integer >= 1, got \"abc\""),
    ('{"prompt": "hi", "max_tokens": 2.9}', "field 'max_tokens' must be an integer >= 1, got 2.9"),  # was sent as 2
    ('{"prompt": "hi", "max_tokens": true}', "field 'max_tokens' must be an integer >= 1, got true"),  # was 1
    ('{"prompt": "hi", "max_tokens": null}', "field 'max_tokens' must be an integer >= 1, got null"),
    ('{"prompt": "\\udc80"}', r"field 'prompt' is not text \(surrogates not allowed at position 0\)"),
    ('{"prompt": ""}', "field 'prompt' is empty"),  # every request failed at the server
])
def test_bench_dataset_max_tokens_named(tmp_path, line, message):
    from epmoe.server.bench import BenchConfig, load_requests

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 3}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"dataset '{path}' line 2: {message}$"):
        load_requests(BenchConfig("http://x", dataset=str(path)))
    path.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 0xff at position 12\)"):
        load_requests(BenchConfig("http://x", dataset=str(path)))


def test_bench_random_prompts_share_their_prefix():
    from epmoe.server.bench import BenchConfig, load_requests

    rows = load_requests(BenchConfig("http://x", num_prompts=3, input_len=4, output_len=2, prefix_len=5, seed=1))
    assert [(len(p), n, m) for p, n, m in rows] == [(9, 9, 2)] * 3
    assert rows[0][0][:5] == rows[1][0][:5] == rows[2][0][:5] and len({tuple(p[5:]) for p, _, _ in rows}) == 3
    with pytest.raises(ValueError, match="prefix_len must be an integer >= 0, got -1"):
        BenchConfig("http://x", prefix_len=-1)


def test_non_streamed_request_aborted_when_client_leaves(server):
    metrics = httpx.get(f"{server.url}/metrics").text
    before = server.metric('epmoe:request_success_total{finished_reason="abort"}') if "abort" in metrics else 0.0
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(30, read=1.0))
    wait_kv_free(server)
    assert server.metric('epmoe:request_success_total{finished_reason="abort"}') - before == 1
    assert server.metric("epmoe:generation_tokens_total") > 0


def _labelled(text: str, name: str) -> dict[str, float]:
    """``{label value: sample}`` of a metric with one label."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            label, value = line[len(name) + 1:].split("} ")
            out[label.split('"')[1]] = float(value)
    return out


def test_metrics_balancedness_per_layer_and_collectives_per_step(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    per_layer = _labelled(text, "epmoe:eplb_balancedness")
    assert sorted(per_layer) == ["0", "1"]  # the 2 MoE layers of the built-in checkpoint
    assert all(0 < v <= 1 for v in per_layer.values()), per_layer
    calls = _labelled(text, "epmoe:collectives_per_step")
    # an eager step on 2 ranks: one all_gather to agree on the batch, per MoE layer 3 all_to_alls (the counts,
    # the tokens, their results)
    assert calls["all_gather"] == 1 and calls["all_to_all"] == 3 * 2, calls


def _core_metrics(server) -> dict[str, float]:
    """The engine core's counters from ``/metrics``: steps by kind (``steps.KIND``), busy and idle seconds,
    tokens-per-step and round-time histogram counts and sums."""
    text = httpx.get(f"{server.url}/metrics").text
    out = {f"steps.{kind}": v for kind, v in _labelled(text, "epmoe:engine_steps_total").items()}
    for name in ("engine_core_busy_seconds_total", "engine_core_idle_seconds_total", "iteration_tokens_total_count",
                 "iteration_tokens_total_sum", "engine_round_seconds_count", "engine_round_seconds_sum"):
        out[name] = server.metric(f"epmoe:{name}")
    return out


def test_metrics_engine_steps_core_time_and_tokens_per_step(server, client):
    """A runs on rank 0; B, sent while A runs, goes to rank 1 and outlives it. Rank 0's steps (eager on CPU:
    no graphs) are A's, then idle ones while only B runs; its tokens per step are A's alone."""
    wait_kv_free(server)
    before = _core_metrics(server)
    fresh = f"metrics probe {uuid.uuid4().hex}"  # no block of it is in the prefix cache (on by default)
    a = client.completions.create(model=MODEL, prompt=fresh, max_tokens=16, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(a)
    next(chunks)  # A is running: B goes to rank 1
    b = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=48, temperature=0,
                                  extra_body={"ignore_eos": True})
    usage_a = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage_a.completion_tokens == 16 and b.usage.completion_tokens == 48
    wait_kv_free(server)
    after = _core_metrics(server)
    d = {k: after[k] - before[k] for k in after}
    assert sorted(k for k in d if k.startswith("steps.")) == [f"steps.{k}" for k in sorted(STEP_KINDS)]
    assert d["steps.graph"] == d["steps.graph_prefill"] == 0
    assert d["steps.eager"] == 16  # A's prefill step, then its 15 decode steps
    steps = d["steps.eager"] + d["steps.idle"]
    # B's 48 steps ran alongside 1..15 of A's (B came after A's first token): rank 0 idled in the rest
    assert 48 - 15 <= d["steps.idle"] <= 48 - 1, d
    assert d["iteration_tokens_total_count"] == d["steps.graph"] + d["steps.eager"]
    assert d["iteration_tokens_total_sum"] == usage_a.prompt_tokens + 16 - 1  # the last token is never fed
    # every round that stepped ran one engine step, but the last: it read B's last token back (overlap schedule)
    assert d["engine_round_seconds_count"] == steps + 1
    assert d["engine_core_busy_seconds_total"] == pytest.approx(d["engine_round_seconds_sum"])
    assert d["engine_core_busy_seconds_total"] > 0 and d["engine_core_idle_seconds_total"] > 0
    # the core's clock runs from its ready message: busy + idle is its time so far but the last wait (up to
    # the 1 s idle round, reported at its end)
    total = after["engine_core_busy_seconds_total"] + after["engine_core_idle_seconds_total"]
    now = time.monotonic()
    assert now - server.ready - 5.0 <= total <= now - server.started, (total, now - server.ready)


def test_eplb_rebalance_moves_experts_and_keeps_outputs(server, client, offline):
    assert httpx.post(f"{server.url}/eplb/rebalance").status_code == 401
    bad = httpx.post(f"{server.url}/eplb/rebalance", json={"max_moves": -1}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_moves"
    unknown = httpx.post(f"{server.url}/eplb/rebalance", json={"max_move": 2}, headers=AUTH)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "max_move"
    assert "Extra inputs are not permitted (got 2)" in unknown.json()["error"]["message"]
    client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)  # loads to balance
    loads_before = httpx.get(f"{server.url}/eplb/loads", headers=AUTH).json()["load"]
    r = httpx.post(f"{server.url}/eplb/rebalance", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["committed"] is True and doc["error"] is None, doc
    assert doc["copies_moved"] == len(doc["moves"]) > 0
    assert all(m["old_expert"] != m["new_expert"] and 0 <= m["layer"] < 2 and 0 <= m["slot"] < 16
               for m in doc["moves"])
    assert doc["balancedness_after"] > doc["balancedness_before"]
    # the moved weights serve the same model: greedy outputs unchanged
    ref = offline(PROMPTS, 12)
    hits = server.metric("epmoe:prefix_cache_hits_total")
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    hits = server.metric("epmoe:prefix_cache_hits_total") - hits  # prompt tokens the prefix cache served
    assert [c.text for c in got.choices] == [o.text for o in ref] and hits > 0
    # loads since start carry over the move (kept per logical expert)
    after = httpx.get(f"{server.url}/eplb/loads", headers=AUTH).json()["load"]
    routed = 4 * (sum(len(p.encode()) + 11 for p in PROMPTS) - hits)  # top-4, each fed prompt token, 11 fed back
    assert [sum(row) for row in after] == [sum(row) + routed for row in loads_before]
    assert all(a >= b for ra, rb in zip(after, loads_before) for a, b in zip(ra, rb))
    again = httpx.post(f"{server.url}/eplb/rebalance", json={"max_moves": 0}, headers=AUTH, timeout=60).json()
    assert again["committed"] is False and again["moves"] == [] and again["error"] is None
    assert "max_moves is 0" in again["skipped"]


def test_eplb_interval_logs_every_periodic_rebalance(start_server):
    """``--eplb-interval 4``: the engine rebalances by itself every 4 steps; the server logs one line for each, with
    its step, outcome, copies moved and balancedness before -> after; a ``POST /eplb/rebalance`` is answered, not
    logged."""
    eplb = start_server("--ep", "2", "--eplb-interval", "4")
    client = openai.OpenAI(base_url=f"{eplb.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    wait_kv_free(eplb)
    text = httpx.get(f"{eplb.url}/metrics").text
    kinds = _labelled(text, "epmoe:engine_steps_total")
    steps = int(sum(v for kind, v in kinds.items() if kind != "graph_prefill"))  # a graph prefill step is a graph one
    assert steps >= 12, kinds  # every prompt's prefill and 11 decode steps at least
    line = re.compile(r"epmoe\.serve (INFO|WARNING) EPLB rebalance at step (\d+): (.*)")
    deadline = time.monotonic() + 10.0  # the HTTP process logs a round's events when it reads the round
    while len(found := line.findall(eplb.log.read_text())) < steps // 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [int(s) for _, s, _ in found] == list(range(4, steps + 1, 4)), eplb.log.read_text()
    committed = re.compile(r"committed, (\d+) expert cop(?:y|ies) moved, balancedness (\d\.\d{3}) -> (\d\.\d{3})")
    outcomes = [committed.fullmatch(rest) for _, _, rest in found]
    assert outcomes[0] is not None and found[0][0] == "INFO", found  # 4 steps of routed tokens: a move balances better
    for level, _, rest in found:
        m = committed.fullmatch(rest)
        if m is not None:
            moved, before, after = int(m[1]), float(m[2]), float(m[3])
            assert moved > 0 and 0 < before < after <= 1, rest
        else:
            assert level == "INFO" and re.fullmatch(r"skipped, balancedness \d\.\d{3}: .+", rest), rest
    answered = httpx.post(f"{eplb.url}/eplb/rebalance", json={"max_moves": 0}, headers=AUTH, timeout=60).json()
    assert answered["committed"] is False and answered["step"] == steps and answered["skipped"], answered
    time.sleep(0.5)  # the next idle round's report
    assert line.findall(eplb.log.read_text()) == found


def test_speculative_server_equals_offline_and_reports_acceptance(start_server, offline):
    """``--speculative-algorithm ngram`` on one rank: the same greedy text as plain decoding offline, the
    proposer in the start-up log, and the acceptance counts in ``/metrics``."""
    spec = start_server("--ep", "1", "--speculative-algorithm", "ngram", "--speculative-num-tokens", "3")
    client = openai.OpenAI(base_url=f"{spec.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompts = ["abcabcabcabcabcabc", *PROMPTS[:2]]
    for prompt, out in zip(prompts, offline(prompts, 16)):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == out.text
    steps = spec.metric("epmoe:spec_decode_num_drafts_total")
    proposed = spec.metric("epmoe:spec_decode_num_draft_tokens_total")
    accepted = spec.metric("epmoe:spec_decode_num_accepted_tokens_total")
    assert steps > 0 and proposed >= steps and 0 < accepted <= proposed
    assert spec.metric("epmoe:spec_decode_mean_accepted_length") == pytest.approx((accepted + steps) / steps)
    assert spec.metric("epmoe:spec_decode_request_accepted_length_count") == 3
    # one rank, one request at a time: each a prefill step, then decode steps of one row plus its drafts
    eager = spec.metric('epmoe:engine_steps_total{kind="eager"}')
    assert spec.metric("epmoe:iteration_tokens_total_count") == eager
    assert spec.metric("epmoe:iteration_tokens_total_sum") == (spec.metric("epmoe:prompt_tokens_total") + eager - 3
                                                               + proposed)
    assert "speculative decoding, K = 3: ngram: prompt lookup" in spec.log.read_text()
    for field, value in (("presence_penalty", 0.5), ("logit_bias", {"5": 1.0})):
        with pytest.raises(openai.BadRequestError, match=f"{field}=.* is not served with speculative decoding "
                                                         r"\(ngram\)$"):  # the algorithm, not the server's paths
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **{field: value})
    with pytest.raises(openai.BadRequestError, match=r"presence_penalty must be in \[-2, 2\], got 3"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, presence_penalty=3)  # the range first
    zero = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=16, temperature=0,
                                     logit_bias={"5": 0}, presence_penalty=0)  # neutral values are served
    assert zero.choices[0].text == offline(prompts[:1], 16)[0].text
    # logprobs and min_p are served with it: the target's own log-probabilities at the emitted tokens
    whole = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=16, temperature=0, logprobs=1,
                                      extra_body={"min_p": 0.1})
    ref = offline(prompts[:1], 16, logprobs=1)[0]
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
