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

MAX_ROUNDS = 100_000  # a round with nothing to step (only compiles pending) takes microseconds: bounded by time too
MAX_SECONDS = 60

@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(ensure_default_checkpoint()), max_num_seqs=4))


def _params(**so) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, structured_outputs=so or None)


def _until_finished(stepper: RankStepper, ids: set[str], first: Control | None = None) -> dict[str, list]:
    """Rounds (``first``, then plain steps) until every request of ``ids`` reported finished (at most
    ``MAX_ROUNDS`` rounds and ``MAX_SECONDS``); each's updates."""
    seen: dict[str, list] = {i: [] for i in ids}
    control = first or Control(step=True)
    deadline = time.monotonic() + MAX_SECONDS
    for _ in range(MAX_ROUNDS):
        for u in stepper.lead(control)[0].updates:
            seen.setdefault(u.request_id, []).append(u)
        if all(any(u.finished for u in seen[i]) for i in ids):
            return seen
        if time.monotonic() > deadline:
            break
        control = Control(step=True)
    raise AssertionError(f"not finished within {MAX_ROUNDS} rounds and {MAX_SECONDS} s: {seen}")


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
    seen = _until_finished(stepper, {"gbnf"}, Control(add=((0, NewRequest("gbnf", [5, 6], _params(grammar=gbnf))),),
                                                     step=True))
    final = [u for u in seen["gbnf"] if u.finished][0]
    assert final.error is None and final.text in ("gbanf", "gbbnf")
    assert callers and not any(callers), "the grammar was converted in the stepping thread"
    lark = StructuredOutputs(grammar=gbnf).as_lark()
    assert lark.grammar != gbnf and lark.as_lark() is lark  # converted once; Lark stays as it is


def test_an_engine_error_mid_generation_is_the_requests_error(engine):
    """A constraint llguidance gives up on while matching (2,500 alternatives sharing a prefix) ends the request
    with the engine's message as its error, which the HTTP side answers with (not a successful ``stop``)."""
    n = 2500
    grammar = ("start: " + " | ".join(f"r{i}" for i in range(n)) + "\n"
               + "\n".join(f'r{i}: "l2x{i}" /[0-9]+/' for i in range(n)))
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=40, structured_outputs={"grammar": grammar})
    seen = _until_finished(RankStepper(engine, None), {"big"},
                           Control(add=((0, NewRequest("big", list(b"constrained 2"), params)),), step=True))
    final = [u for u in seen["big"] if u.finished][0]
    assert final.finish_reason == "abort" and "the constraint engine (llguidance) gave up" in final.error


def test_core_waits_instead_of_stepping_while_only_grammars_compile(engine, monkeypatch):
    """With every open request waiting for its grammar, the engine core polls every ``COMPILE_POLL_S`` without
    stepping (it ran empty steps back to back, reporting each over the pipe); the request is served once its
    grammar is ready."""
    from multiprocessing import Pipe

    from epmoe.server.core import COMPILE_POLL_S, EngineCore

    release = threading.Event()
    real = engine.compile_constraint
    monkeypatch.setattr(engine, "compile_constraint", lambda spec: (release.wait(30), real(spec)))
    here, there = Pipe()
    core = EngineCore(RankStepper(engine, None), there, idle_round_s=0.05)
    runner = threading.Thread(target=core.run, daemon=True)
    runner.start()
    assert here.poll(30) and here.recv()[0][0] == "ready"
    here.send([("add", NewRequest("held", [5, 6], _params(choice=["on", "off"])))])
    reports, start = [], time.monotonic()
    while time.monotonic() - start < 0.5:  # half a second of compiling: rounds at most every COMPILE_POLL_S
        if here.poll(0.01):
            reports += [v for kind, v in here.recv() if kind == "step"]
    assert 0 < len(reports) <= 0.5 / COMPILE_POLL_S + 5
    assert all(r.round_s is None for r in reports[1:]) and reports[-1].waiting == 1 and reports[-1].running == 0
    release.set()
    final, deadline = None, time.monotonic() + 60
    while final is None and time.monotonic() < deadline:
        if here.poll(0.1):
            final = next((u for kind, v in here.recv() if kind == "step" for u in v.updates if u.finished), None)
    assert final is not None and final.request_id == "held" and final.text in ("on", "off")
    here.send([("stop", None)])
    runner.join(30)
    assert not runner.is_alive()
