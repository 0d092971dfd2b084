"""Structured outputs through the engine (CPU, the built-in checkpoint with its byte-level tokenizer): outputs hold
to their JSON schema, regular expression, choice or grammar under both schedules; the constraint picks the most
likely allowed token (checked against the same request's raw log-probabilities without it); bad constraints are
refused before anything is queued."""

import json
import math
import re

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.engine.structured import StructuredOutputs
from epmoe.models.tiny import ensure_default_checkpoint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 5}, "size": {"enum": ["S", "M", "L"]}}}


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_default_checkpoint())


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=model_dir, max_num_seqs=4))


def _constrained(**kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA,
                                                                             "disable_any_whitespace": True}),
            SamplingParams(temperature=0.9, seed=5, max_tokens=40, structured_outputs={"regex": r"[a-z]{3}-\d{2}"}),
            # a penalty beside the constraint: its token counts live until the constraint ends the request
            SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3,
                           structured_outputs={"choice": ["red", "green", "blue"]}),
            SamplingParams(temperature=0, max_tokens=40, structured_outputs={"grammar": 'start: "<" ("a" | "b")+ ">"'}),
            SamplingParams(temperature=0, max_tokens=6)]


def test_outputs_hold_to_their_constraints_in_both_schedules(engine):
    prompts = ["describe a shirt:", "a code:", "a colour:", "tags:", "free text"]
    runs = []
    for overlap in (True, False):
        engine.overlap = overlap
        runs.append(engine.generate(prompts, _constrained()))
    engine.overlap = True
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    obj, code, colour, tags, free = runs[0]
    value = json.loads(obj.text)
    assert set(value) == {"name", "size"} and len(value["name"]) <= 5 and value["size"] in "SML"
    assert re.fullmatch(r"[a-z]{3}-\d{2}", code.text) and colour.text in ("red", "green", "blue")
    done = tags.finish_reason == "stop"
    assert re.fullmatch(r"<[ab]+>" if done else r"<[ab]+", tags.text) and (done or len(tags.token_ids) == 40)
    # complete constraints stop at once (their last token kept in the text); the plain request is untouched
    assert [o.finish_reason for o in (obj, code, colour)] == ["stop"] * 3
    assert len(colour.token_ids) == len(colour.text)  # one byte token a character, no EOS generated
    assert free.finish_reason == "length" and len(free.token_ids) == 6


def test_the_most_likely_allowed_token_wins(engine):
    """Without a constraint, the first token's raw top-20; with a choice of two of those characters (the less likely
    listed first), the output is the more likely one, at its probability among the two."""
    free = engine.generate(["pick:"], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0]
    top = [(tid, lp) for tid, lp in free.logprobs[0].top if engine.tokenizer.decode([tid]).isalpha()]
    assert len(top) >= 2
    (best, _), (worse, _) = top[0], top[-1]
    a, b = engine.tokenizer.decode([best]), engine.tokenizer.decode([worse])
    got = engine.generate(["pick:"], SamplingParams(temperature=0, max_tokens=4, logprobs=1,
                                                    structured_outputs={"choice": [b, a]}))[0]
    assert got.text == a and got.token_ids == [best] and got.finish_reason == "stop"
    # its log-probability is the constrained distribution's (the mask comes before the log-softmax, as vLLM's)
    la, lb = dict(free.logprobs[0].top)[best], dict(free.logprobs[0].top)[worse]
    assert got.logprobs[0].logprob == pytest.approx(la - math.log(math.exp(la) + math.exp(lb)), abs=1e-5)


@pytest.mark.parametrize("spec, message", [
    ({"regex": "([a"}, r"structured_outputs.regex does not compile: .*unclosed"),
    ({"json": {"type": "objec"}}, r"structured_outputs.json does not compile: .*objec"),
    ({"json": "{not json"}, r"structured_outputs.json is not JSON"),
    ({"grammar": "start: nothing_defined"}, r"structured_outputs.grammar does not compile"),
    ({"json": "5"}, r"structured_outputs.json must be a JSON schema object, got 5"),
    ({"json": {"enum": ["\ud800"]}}, r"structured_outputs.json '\{\"enum\": \[\"\\ud800\"\]\}' is not valid Unicode "
                                    r"text: a lone surrogate '\\ud800' at position 11"),
    ({"regex": "a\ud800"}, r"structured_outputs.regex 'a\\ud800' is not valid Unicode text: a lone surrogate "
                           r"'\\ud800' at position 1"),
    ({"choice": ["ok", "\udc80"]}, r"structured_outputs.choice\[1\] '\\udc80' is not valid Unicode text"),
    # the list as sent (was shown as the tuple it is kept as: got ())
    ({"choice": []}, r"structured_outputs.choice must be a non-empty list of non-empty strings, got \[\]$"),
    ({"choice": ["a", ""]}, r"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                            r"\['a', ''\]$"),
])
def test_constraints_that_do_not_compile_are_refused_before_queueing(engine, spec, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished()


def test_a_choice_of_many_entries_or_of_prefixes(engine):
    """70,000 choices (more than llguidance takes as alternatives of one rule) compile, and the output is one of
    them; of two choices where one is the other's prefix, either can be the output (the logit bias picks)."""
    many = [f"choice-{i}" for i in range(70_000)]
    (out,) = engine.generate(["pick:"], SamplingParams(temperature=0, max_tokens=16,
                                                       structured_outputs={"choice": many}))
    assert out.text in set(many) and out.finish_reason == "stop"
    short, long = (engine.generate(["pick:"], SamplingParams(temperature=0, max_tokens=4, logit_bias={tok: 100},
                                                             structured_outputs={"choice": ["a", "ab"]}))[0]
                   for tok in (sorted(engine.eos_ids)[0], ord("b")))
    assert (short.text, short.finish_reason) == ("a", "stop") and (long.text, long.finish_reason) == ("ab", "stop")


def test_a_grammar_in_gbnf(engine):
    """vLLM's users send llama.cpp's GBNF (rule ``root``; xgrammar's EBNF) as well as Lark: both are served, as by
    vLLM's guidance backend; GBNF without its ``root`` rule is refused, named."""
    (out,) = engine.generate(["x"], SamplingParams(temperature=0, max_tokens=8, structured_outputs={
        "grammar": 'root ::= ("yes" | "no") "!"'}))
    assert out.text in ("yes!", "no!") and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="structured_outputs.grammar does not compile: No 'root' rule found"):
        engine.add_request("x", SamplingParams(structured_outputs={"grammar": 'answer ::= "yes"'}))
    assert not engine.has_unfinished()


def test_min_tokens_yields_where_its_bans_leave_the_constraint_no_token(engine):
    """min_tokens bans the stop token ids before it; where the constraint allows only those ('b' after 'a' in
    "ab"), the ban yields (as when a constraint completes before min_tokens) instead of the step sampling from no
    token at all, which gave token 0, outside the constraint."""
    for temperature in (0, 1.0):
        (out,) = engine.generate(["x"], SamplingParams(temperature=temperature, seed=1, max_tokens=5, min_tokens=2,
                                                       stop_token_ids=[ord("b")],
                                                       structured_outputs={"choice": ["ab", "b"]}))
        assert (out.token_ids, out.text, out.finish_reason) == ([ord("a"), ord("b")], "a", "stop")


def test_bad_structured_outputs_named():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got regex, choice"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one .* got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match=r"structured_outputs has unknown field\(s\) \['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputs or a dict"):
        SamplingParams(structured_outputs="json")
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")


def test_not_served_with_speculative_decoding_or_without_a_tokenizer(model_dir, tmp_path):
    spec = Engine(EngineConfig(model=model_dir, speculative_algorithm="ngram", speculative_num_tokens=2))
    with pytest.raises(ValueError, match="structured_outputs are not served with speculative decoding"):
        spec.add_request("x", SamplingParams(structured_outputs={"choice": ["a"]}))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((ensure_default_checkpoint() / "config.json").read_text())
    dummy = Engine(EngineConfig(model=str(bare), load_format="dummy", max_model_len=64))
    with pytest.raises(ValueError, match="structured_outputs need the checkpoint's tokenizer"):
        dummy.add_request("x", SamplingParams(structured_outputs={"choice": ["a"]}))


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(engine):
    """A request's choices and a repeated schema share one compiled grammar; their matchers advance apart."""
    grammars = engine.admission.compiler()
    before = len(grammars._compiled)
    spec = StructuredOutputs(regex="ab|ac")
    a, b = grammars.matcher(spec), grammars.matcher(spec)
    assert len(grammars._compiled) == before + 1
    assert a.accept(ord("a")) and a.accept(ord("b")) and a.stopped and not b.stopped
    assert b.accept(ord("a")) and b.accept(ord("c")) and b.stopped


def test_a_constraint_engine_that_gives_up_mid_generation_ends_the_request_with_its_reason(engine):
    """llguidance's parser has limits it meets only while matching (2,500 alternatives sharing a prefix exceed the
    items of one parser row): its matcher then errs and reports itself stopped, which ended the request with
    ``stop`` and text outside the constraint ('l'). Now the request ends ``abort`` with llguidance's reason, and
    the engine serves on."""
    n = 2500
    grammar = ("start: " + " | ".join(f"r{i}" for i in range(n)) + "\n"
               + "\n".join(f'r{i}: "l2x{i}" /[0-9]+/' for i in range(n)))
    (out,) = engine.generate(["constrained 2"], SamplingParams(temperature=0.8, seed=2, max_tokens=40,
                                                               structured_outputs={"grammar": grammar}))
    assert out.finish_reason == "abort" and out.finished
    assert out.error.startswith("structured_outputs: the constraint engine (llguidance) gave up at output token ")
    (fine,) = engine.generate(["x"], SamplingParams(temperature=0, max_tokens=8,
                                                    structured_outputs={"choice": ["yes", "no"]}))
    assert fine.text in ("yes", "no") and fine.finish_reason == "stop" and fine.error is None
    assert not engine.has_unfinished()


def test_a_grammar_over_llguidances_limits_is_refused_in_one_line(engine):
    """40,000 rules exceed llguidance's symbol count: its panic is the refusal's reason, without the backtrace it
    appends (a hundred frames of native addresses and build paths)."""
    n = 40_000
    grammar = ("start: " + " | ".join(f"r{i}" for i in range(n)) + "\n"
               + "\n".join(f'r{i}: "x{i}" /[0-9]+/' for i in range(n)))
    with pytest.raises(ValueError) as err:
        engine.add_request("x", SamplingParams(structured_outputs={"grammar": grammar}))
    message = str(err.value)
    assert message.startswith("structured_outputs.grammar does not compile: ") and "backtrace" not in message
    assert len(message) < 300 and not engine.has_unfinished()
