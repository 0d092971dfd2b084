"""``build_job``: requests to engine requests, and the 400s it answers (no server process: the built-in
checkpoint's tokenizer and a model of its context)."""

from __future__ import annotations

import json
import shutil

import pytest

from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.server.core import EngineInfo
from epmoe.server.errors import ApiError
from epmoe.server.generate import build_job
from epmoe.server.protocol import ChatCompletionRequest, CompletionRequest
from epmoe.server.text import TextCodec

MODEL = "kimi-k2.5-tiny"
INFO = EngineInfo(max_model_len=256, vocab_size=259, ranks=1, parallel="ep", kv={"blocks": 4096, "block_size": 16})


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(str(ensure_default_checkpoint()), INFO.vocab_size)


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, **fields}, strict=True)


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, **fields}, strict=True)


def _refused(req, codec) -> ApiError:
    with pytest.raises(ApiError) as err:
        build_job(req, MODEL, codec, INFO)
    return err.value


@pytest.mark.parametrize("req, param, position", [
    (lambda: _completion(prompt="ok \ud800"), "prompt", 3),
    (lambda: _completion(prompt=["fine", "\udc80 bad"]), "prompt", 0),
    (lambda: _completion(prompt="hi", stop=["x", "\udfff"]), "stop", 0),
    (lambda: _chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\ud83d"}]),
     "messages.1.content", 1),
], ids=["prompt", "second prompt", "stop", "chat content"])
def test_lone_surrogate_refused_naming_the_field(codec, req, param, position):
    # JSON's "\ud800" escapes decode to lone surrogates, which no tokenizer can take: a 400, not a 500
    error = _refused(req(), codec)
    assert error.status == 400 and error.param == param
    assert error.message.startswith(f"{param} ") and f"at position {position}" in error.message


def test_seed_near_the_top_wraps_per_choice(codec):
    job = build_job(_completion(prompt="hi", seed=2**63 - 1, n=3, max_tokens=2), MODEL, codec, INFO)
    assert [p.seed for p in job.params] == [2**63 - 1, 0, 1]
    job = build_job(_completion(prompt="hi", seed=7, n=2, max_tokens=2), MODEL, codec, INFO)
    assert [p.seed for p in job.params] == [7, 8]
    for bad in (-1, 2**63):  # refused as sent, never wrapped into range
        error = _refused(_completion(prompt="hi", seed=bad, n=2, max_tokens=2), codec)
        assert error.status == 400 and error.param == "seed" and f"got {bad}" in error.message


def test_chat_template_refusing_the_conversation_is_a_400(tmp_path):
    ckpt = ensure_default_checkpoint()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (  # as Mixtral's: roles must alternate
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    codec = TextCodec(str(tmp_path), INFO.vocab_size)
    good = build_job(_chat(messages=[{"role": "user", "content": "hi"}], max_tokens=2), MODEL, codec, INFO)
    assert good.prompts == [codec.encode("[user] hi")]
    error = _refused(_chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]), codec)
    assert error.status == 400 and error.param == "messages"
    assert "Conversation roles must alternate" in error.message


def test_chat_without_max_tokens_gets_what_the_context_leaves(codec):
    req = _chat(messages=[{"role": "user", "content": "hello there"}])
    prompt = len(build_job(req, MODEL, codec, INFO).prompts[0])
    assert build_job(req, MODEL, codec, INFO).params[0].max_tokens == 256 - prompt
    # a conversation as long as the context: the error names no max_tokens the client did not send
    long = _chat(messages=[{"role": "user", "content": "x" * 300}])
    with pytest.raises(ApiError) as err:
        build_job(long, MODEL, codec, INFO)
    assert err.value.param == "messages" and "max_tokens" not in err.value.message
    assert "no room left in the model's context of 256 tokens" in err.value.message


def test_a_bad_prompt_of_a_batch_is_named_by_its_place(codec):
    """A list of prompts named the bad one "prompt", as the stop list names its items ("stop.1") only for stops."""
    for prompt, param, message in ((["hi", "x" * 300], "prompt.1", "prompt.1 has 300 tokens: no room left"),
                                   ([[5, 6], [7, 999]], "prompt.1", "prompt.1 token ids must be in [0, 259)"),
                                   ("x" * 300, "prompt", "prompt has 300 tokens"),
                                   ([5, 999], "prompt", "prompt token ids must be in [0, 259)")):
        error = _refused(_completion(prompt=prompt, max_tokens=2), codec)
        assert (error.status, error.param) == (400, param) and message in error.message, error.message


def test_generation_config_defaults_fill_only_the_fields_left_out(codec, tmp_path):
    from epmoe.engine.sampling import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 7, "eos_token_id": 2}))
    defaults = sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    (p,) = build_job(_completion(prompt="hi", max_tokens=3), MODEL, codec, INFO, defaults).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.95, 20, 0.0, 3)
    sent = _completion(prompt="hi", max_tokens=3, temperature=0, top_k=None)  # null: left out
    (p,) = build_job(sent, MODEL, codec, INFO, defaults).params
    assert (p.temperature, p.top_p, p.top_k) == (0, 0.95, 20)
    (p,) = build_job(_chat(messages=[{"role": "user", "content": "hi"}]), MODEL, codec, INFO, defaults).params
    assert p.max_tokens == 7  # a chat without max_tokens: max_new_tokens caps what the context leaves
    (p,) = build_job(_chat(messages=[{"role": "user", "content": "hi"}]), MODEL, codec, INFO).params
    assert p.max_tokens > 7 and p.temperature == 1.0
    assert sampling_defaults(str(tmp_path / "none")) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p: top_p must be in \(0, 1\], got 1.5"):
        sampling_defaults(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="generation_config.json' cannot be read"):
        sampling_defaults(str(tmp_path))


def test_chat_template_from_a_file_or_inline(codec, tmp_path):
    from epmoe.server.text import load_chat_template

    inline = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert load_chat_template(inline) == inline
    (tmp_path / "t.jinja").write_text(inline)
    assert load_chat_template(str(tmp_path / "t.jinja")) == inline
    custom = TextCodec(str(ensure_default_checkpoint()), INFO.vocab_size, inline)
    assert custom.chat_prompt([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    hf = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert load_chat_template(hf) == hf  # transformers' tags (loop controls, generation) parse
    assert TextCodec(str(ensure_default_checkpoint()), INFO.vocab_size, hf).chat_prompt(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"
    with pytest.raises(ValueError, match="'no-such-file' is neither a file nor a Jinja template"):
        load_chat_template("no-such-file")
    with pytest.raises(ValueError, match=r"chat_template does not parse: .* \(line 1\)"):
        load_chat_template("{% for m in messages %}")


def test_completions_add_the_tokenizers_bos_and_chats_do_not(tmp_path):
    # vLLM encodes a completion's text with the tokenizer's special tokens (add_special_tokens true) and a chat's
    # rendered template without them: a tokenizer that adds a BOS gets it once
    from tokenizers import Tokenizer, processors

    d = tmp_path / "ckpt"
    shutil.copytree(ensure_default_checkpoint(), d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tok.save(str(d / "tokenizer.json"))
    codec = TextCodec(str(d), INFO.vocab_size)
    assert codec.encode("hi") == [256, 104, 105] and codec.encode("hi", False) == [104, 105]
    assert build_job(_completion(prompt="hi", max_tokens=2), MODEL, codec, INFO).prompts == [[256, 104, 105]]
    no_bos = _completion(prompt="hi", max_tokens=2, add_special_tokens=False)
    assert build_job(no_bos, MODEL, codec, INFO).prompts == [[104, 105]]
    chat = build_job(_chat(messages=[{"role": "user", "content": "hi"}], max_tokens=2), MODEL, codec, INFO)
    assert chat.prompts[0][0] != 256 and chat.prompts == [codec.encode(codec.chat_prompt(
        [{"role": "user", "content": "hi"}]), False)]
    from epmoe.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(d), max_num_seqs=2, num_kv_blocks=8, block_size=16))
    assert engine.encode("hi") == [256, 104, 105]  # the offline API encodes as vLLM's LLM.generate


def test_a_completion_without_max_tokens_is_capped_by_the_context(codec):
    """A completion that sends no max_tokens takes 16 (or generation_config's), capped by what the context leaves,
    as vLLM does (it was a 400 naming 'max_tokens (16)', a value the request never sent); one that sends it past the
    context is still refused, naming it."""
    prompt = list(range(250))  # 250 of the context's 256 tokens
    assert build_job(_completion(prompt=prompt), MODEL, codec, INFO).params[0].max_tokens == 6
    assert build_job(_completion(prompt=prompt), MODEL, codec, INFO, {"max_tokens": 100}).params[0].max_tokens == 6
    assert build_job(_completion(prompt=[1, 2]), MODEL, codec, INFO).params[0].max_tokens == 16
    error = _refused(_completion(prompt=prompt, max_tokens=16), codec)
    assert (error.status, error.param) == (400, "max_tokens")
    assert error.message == "max_tokens (16) plus the prompt's 250 tokens is past the model's context of 256 tokens"
    # in a batch, the longest prompt is named by its position
    error = _refused(_completion(prompt=[[1, 2], prompt, prompt[:3]], max_tokens=16), codec)
    assert (error.status, error.param) == (400, "max_tokens")
    assert error.message == "max_tokens (16) plus prompt.1's 250 tokens is past the model's context of 256 tokens"


def test_a_message_without_content_parts_is_refused(codec):
    """A user message whose content was an empty array was answered from the bare template (OpenAI's API refuses
    it); one without content at all was already a 400. An empty string stays a message (OpenAI's API takes it)."""
    error = _refused(_chat(messages=[{"role": "user", "content": []}], max_tokens=4), codec)
    assert (error.status, error.param) == (400, "messages.0.content")
    assert error.message == ("messages.0.content: an empty array; give at least one content part or a string")
    error = _refused(_chat(messages=[{"role": "system", "content": "be brief"}, {"role": "user"}]), codec)
    assert (error.status, error.param) == (400, "messages.1.content")
    assert build_job(_chat(messages=[{"role": "user", "content": ""}], max_tokens=4), MODEL, codec, INFO).prompts


def test_a_tool_reply_to_no_call_is_refused(codec):
    """A chat whose tool message answers a call id no assistant message made was served from the template; the
    Responses API refused the same conversation."""
    error = _refused(_chat(messages=[{"role": "tool", "tool_call_id": "zzz", "content": "42"}]), codec)
    assert (error.status, error.param) == (400, "messages.0.tool_call_id")
    assert error.message == ("messages.0.tool_call_id: no assistant message before it has a tool call with id 'zzz'")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answered = _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "c1", "content": "42"}], max_tokens=4)
    assert build_job(answered, MODEL, codec, INFO).prompts
