"""``RankStepper`` (one rank, CPU, the built-in checkpoint): a request whose grammar is not compiled yet waits in a
worker thread while the running requests keep stepping, then joins; an abort drops it; a grammar that does not
compile is the request's error; a compiled one joins at once."""

from __future__ import annotations

import threading
import time

import pytest

from epmoe.engine import Engine, EngineConfig, SamplingParams
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.server.ranks import Control, NewRequest, RankStepper

MAX_ROUNDS = 200


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(ensure_default_checkpoint()), max_num_seqs=4))


def _params(**so) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, structured_outputs=so or None)


def _until_finished(stepper: RankStepper, ids: set[str], first: Control | None = None) -> dict[str, list]:
    """Rounds (``first``, then plain steps) until every request of ``ids`` reported finished; each's updates."""
    seen: dict[str, list] = {i: [] for i in ids}
    control = first or Control(step=True)
    for _ in range(MAX_ROUNDS):
        for u in stepper.lead(control)[0].updates:
            seen.setdefault(u.request_id, []).append(u)
        if all(any(u.finished for u in seen[i]) for i in ids):
            return seen
        control = Control(step=True)
    raise AssertionError(f"not finished within {MAX_ROUNDS} rounds: {seen}")


def test_uncompiled_grammar_waits_off_the_step_loop_then_joins(engine, monkeypatch):
    stepper = RankStepper(engine, None)
    release = threading.Event()
    real = engine.compile_constraint

    def slow_compile(spec):
        assert release.wait(30), "the test never released the compile"
        real(spec)

    monkeypatch.setattr(engine, "compile_constraint", slow_compile)
    choice = {"choice": ["left-side", "right-side"]}
    plain = NewRequest("plain", [5, 6, 7], _params())
    held = NewRequest("held", [5, 6, 7], _params(**choice))
    reply = stepper.lead(Control(add=((0, plain), (0, held)), step=True))[0]
    assert reply.waiting + reply.running == 2 and "held" in stepper._compiling
    plain_tokens = [t for u in reply.updates if u.request_id == "plain" for t in u.new_token_ids]
    for _ in range(3):  # the plain request keeps stepping while the grammar compiles
        reply = stepper.lead(Control(step=True))[0]
        plain_tokens += [t for u in reply.updates if u.request_id == "plain" for t in u.new_token_ids]
        assert not any(u.request_id == "held" for u in reply.updates)
    assert len(plain_tokens) >= 3
    release.set()
    seen = _until_finished(stepper, {"held", "plain"})
    final = [u for u in seen["held"] if u.finished][0]
    assert final.error is None and final.finish_reason == "stop" and final.text in choice["choice"]
    monkeypatch.undo()
    (direct,) = engine.generate([[5, 6, 7]], _params(**choice))
    assert [t for u in seen["held"] for t in u.new_token_ids] == direct.token_ids
    assert not stepper._compiling and not engine.has_unfinished()


def test_abort_while_compiling_drops_the_request(engine, monkeypatch):
    stepper = RankStepper(engine, None)
    release = threading.Event()
    monkeypatch.setattr(engine, "compile_constraint", lambda spec: release.wait(30))
    req = NewRequest("gone", [5, 6], _params(regex=r"[0-9]{3}z"))
    stepper.lead(Control(add=((0, req),), step=True))
    (reply,) = stepper.lead(Control(abort=((0, "gone"),), step=True))
    assert [(u.request_id, u.finished, u.finish_reason) for u in reply.updates] == [("gone", True, "abort")]
    assert reply.waiting == 0 and not engine.has_unfinished()
    release.set()


def test_grammar_that_does_not_compile_is_the_requests_error_and_a_compiled_one_joins_at_once(engine):
    stepper = RankStepper(engine, None)
    bad = NewRequest("bad", [5], _params(grammar="start: nothing_defined"))
    seen = _until_finished(stepper, {"bad"}, Control(add=((0, bad),), step=True))
    (final,) = seen["bad"]
    assert final.finished and "structured_outputs.grammar does not compile" in final.error
    spec = {"choice": ["yes", "no"]}
    engine.compile_constraint(_params(**spec).structured_outputs)
    (reply,) = stepper.lead(Control(add=((0, NewRequest("ready", [5], _params(**spec))),)))
    assert not stepper._compiling and reply.waiting == 1  # queued in the engine, not compiling
    seen = _until_finished(stepper, {"ready"})
    assert [u for u in seen["ready"] if u.finished][0].text in ("yes", "no")


def test_a_gbnf_grammar_is_never_converted_in_the_step_loop(engine, monkeypatch):
    """A large GBNF grammar's conversion to Lark is Python (over a second at 20,000 rules, holding the interpreter
    lock): the stepping thread must neither convert it to see whether it is compiled nor again when it joins."""
    from epmoe.engine.structured import StructuredOutputs

    callers = []
    real = StructuredOutputs.grammar_text

    def recorded(self):
        callers.append(threading.current_thread() is threading.main_thread())
        return real(self)

    monkeypatch.setattr(StructuredOutputs, "grammar_text", recorded)
    stepper = RankStepper(engine, None)
    gbnf = 'root ::= "gb" ("a" | "b") "nf"\n'
    control, final, deadline = Control(add=((0, NewRequest("gbnf", [5, 6], _params(grammar=gbnf))),), step=True), None, \
        time.monotonic() + 60
    while final is None and time.monotonic() < deadline:  # rounds with nothing to step are fast: bounded by time
        final = next((u for u in stepper.lead(control)[0].updates if u.request_id == "gbnf" and u.finished), None)
        control = Control(step=True)
    assert final is not None, "the constrained request did not finish within 60 s"
    assert final.error is None and final.text in ("gbanf", "gbbnf")
    assert callers and not any(callers), "the grammar was converted in the stepping thread"
    assert StructuredOutputs(grammar=gbnf).as_lark().as_lark().grammar == StructuredOutputs(grammar=gbnf).as_lark().grammar
