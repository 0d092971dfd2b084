"""Structured outputs: a request's tokens held to a JSON schema, a regular expression, a choice of strings or a
grammar (Lark or GBNF) (vLLM's ``structured_outputs``; OpenAI's ``response_format``), through llguidance.

``StructuredOutputs`` names the constraint (exactly one of vLLM's ``json``, ``regex``, ``choice``, ``grammar``,
``json_object``). ``Grammars`` (one per engine) wraps the checkpoint's tokenizer for llguidance once and compiles
a request's constraint into a ``Matcher`` when the request is added, so a schema or expression that does not
compile is refused before anything runs, naming the field and llguidance's reason. At each step the engine asks
every constrained row's matcher for the tokens that may follow (``Matcher.fill``: a bitmask, one bit per token,
computed on the host while the step's forward runs on the device), bans the others in the logits on the device
(``apply_token_bitmask``) before any other adjustment or sampling, and gives the matcher the token sampled
(``Matcher.accept``). A request whose matcher has stopped (the constraint complete, nothing may follow but EOS)
finishes with ``stop``. EOS is allowed where the constraint may end.

Source: llguidance (Microsoft, MIT), the Earley-parser-based constraint engine vLLM ships as its ``guidance``
backend; the bitmask layout (int32 words, bit ``t % 32`` of word ``t // 32`` set for an allowed token) is its.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from epmoe.engine.transfer import to_device

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's generated text (exactly one field set, vLLM's names).

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is a JSON value it validates.
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        choice: strings (a list or tuple; kept as a tuple): the output is one of them.
        grammar: a grammar the output derives: Lark (llguidance's dialect, rule ``start``) or GBNF (llama.cpp's,
            which xgrammar's EBNF follows; rule ``root``).
        json_object: ``True``: the output is a JSON object (OpenAI's ``response_format: json_object``).
        disable_any_whitespace: JSON outputs without whitespace between tokens (vLLM's option; by default
            whitespace may go where JSON allows it).

    Raises:
        ValueError: none or more than one constraint, a field of the wrong type, or text that is not valid Unicode (a
            lone surrogate, which llguidance cannot take), named with its value.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if (getattr(self, k) is not None and k != "json_object") or
                 (k == "json_object" and self.json_object is not False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text), got {value!r}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, tuple) or not value
                                 or not all(isinstance(c, str) and c for c in value)):
            shown = list(value) if isinstance(value, tuple) else value  # the list the caller gave
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {shown!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true when given, got {value!r}")
        if kind == "json":
            _unicode(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False), "json")
        elif kind in ("regex", "grammar"):
            _unicode(value, kind)
        elif kind == "choice":
            for i, c in enumerate(value):
                _unicode(c, f"choice[{i}]")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be true or false, got "
                             f"{self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """The constraint's field name."""
        return next(k for k in KINDS if (getattr(self, k) is not None and k != "json_object")
                    or (k == "json_object" and self.json_object))

    def as_lark(self) -> StructuredOutputs:
        """This constraint with a GBNF ``grammar`` converted to Lark (itself for any other): the same grammar, whose
        ``grammar_text`` then converts nothing. The server's HTTP process sends the engine core this, so the
        conversion (Python, a second or more for a large grammar, holding the interpreter lock) never runs beside the
        core's steps.

        Raises:
            ValueError: a ``grammar`` that is neither Lark nor GBNF, as ``grammar_text``.
        """
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind != "grammar":
            return self
        try:
            lark = any_to_lark(self.grammar)
        except Exception as err:  # the converter raises plain Exceptions too
            raise ValueError(f"structured_outputs.grammar does not compile: {_one_line(str(err))}") from None
        return self if lark == self.grammar else replace(self, grammar=lark)

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (its JSON or Lark text).

        A ``choice`` is one Lark terminal of the strings (one lexeme): as alternatives of the start rule, each string
        is a lexeme of its own, which takes llguidance time growing faster than the number of strings and fails
        past about 65,000 of them.

        Raises:
            ValueError: ``json`` text that is not JSON or not a JSON object, named with its value; a ``grammar`` that
                is neither Lark nor GBNF, named with the converter's reason.
        """
        from llguidance import LLMatcher

        kind = self.kind
        if kind in ("json", "json_object"):
            schema = self.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise ValueError(f"structured_outputs.json is not JSON: {err}") from None
            if not isinstance(schema, dict):
                shown = json.dumps(schema)
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got "
                                 f"{shown if len(shown) <= 80 else shown[:77] + '...'}")
            return LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": not self.disable_any_whitespace})
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, self.choice)))
        # Lark as it is, GBNF converted (llguidance's own reading, as vLLM's guidance backend)
        return LLMatcher.grammar_from_lark(self.as_lark().grammar)


class Matcher:
    """One request's position in its constraint (llguidance's ``LLMatcher``)."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``row`` (``[W]`` int32, contiguous, on the CPU; ``W = ceil(V / 32)``):
        bit ``t % 32`` of word ``t // 32`` set where token ``t`` may follow."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> bool:
        """Advance past ``token``; ``False`` where the constraint does not allow it (the matcher keeps its state)."""
        return bool(self._m.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        """The constraint is complete and nothing but EOS may follow (or the matcher failed: see ``error``)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        """Why llguidance gave up matching (a limit of its parser reached mid-generation, for example "Current row
        has 2001 items; max is 2000"), else ``None``."""
        return _one_line(self._m.get_error()) if self._m.is_error() else None


class Grammars:
    """Compiles requests' constraints against one tokenizer (llguidance's tokenizer built once, about a second).

    Attributes:
        CACHED: compiled grammars kept for reuse (least recently used dropped first).

    Args:
        tokenizer: the checkpoint's fast Hugging Face tokenizer (``None``: refused).
        vocab_size: the model's vocabulary size (its logits' width; may exceed the tokenizer's).
        eos_ids: the token ids that end a generation (allowed where the constraint may end); empty: the
            tokenizer's EOS.

    Raises:
        ImportError: llguidance is not installed (named with the package to install).
        ValueError: no tokenizer, or not a fast one llguidance can read.
    """

    CACHED = 64

    def __init__(self, tokenizer, vocab_size: int, eos_ids) -> None:
        if tokenizer is None:
            raise ValueError("structured_outputs need the checkpoint's tokenizer, and this checkpoint has none")
        try:
            import llguidance.hf
        except ImportError as err:
            raise ImportError(f"structured outputs need the llguidance package (pip install llguidance): {err}") \
                from None
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                           eos_token=sorted(eos_ids) or None)
        except Exception as err:  # llguidance raises its own types for tokenizers it cannot read
            raise ValueError(f"structured outputs cannot use this checkpoint's tokenizer ({type(tokenizer).__name__}):"
                             f" {err}") from None
        self.vocab_size = int(vocab_size)
        self.words = -(-self.vocab_size // 32)
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar text -> compiled LLMatcher, never advanced
        # the constraint as sent -> its grammar text: a GBNF grammar's conversion to Lark is Python (a large one takes
        # a second or more, holding the interpreter lock), so it runs once per constraint, in the thread that compiles
        self._texts: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()

    def _text(self, spec: StructuredOutputs) -> str:
        """``spec.grammar_text()``, converted once per constraint (the ``CACHED`` most recent kept)."""
        key = _key(spec)
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        text = spec.grammar_text()
        with self._lock:
            self._texts[key] = text
            while len(self._texts) > self.CACHED:
                self._texts.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A new matcher at the start of ``spec``'s constraint: a copy of the compiled one where the same grammar
        was compiled lately (the ``CACHED`` most recent are kept; a request's ``n`` choices, or clients sending one
        schema again and again, compile it once). Thread-safe.

        Raises:
            ValueError: the constraint does not compile (``structured_outputs.<kind>`` named, with llguidance's
                reason).
        """
        from llguidance import LLMatcher

        text = self._text(spec)
        with self._lock:
            compiled = self._compiled.get(text)
            if compiled is not None:
                self._compiled.move_to_end(text)
        if compiled is None:
            compiled = LLMatcher(self._tokenizer, text, log_level=0)  # compiles; an error is kept, not raised
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{spec.kind} does not compile: {_one_line(compiled.get_error())}")
            with self._lock:
                self._compiled[text] = compiled
                while len(self._compiled) > self.CACHED:
                    self._compiled.popitem(last=False)
        return Matcher(compiled.deep_copy())

    def is_compiled(self, spec: StructuredOutputs) -> bool:
        """Whether ``matcher(spec)`` would copy a compiled grammar (no compile). Thread-safe, and cheap: a constraint
        whose grammar text was not made yet is not compiled (nothing is converted here; the step loop asks this of
        every new constrained request)."""
        with self._lock:
            text = self._texts.get(_key(spec))
            return text is not None and text in self._compiled

    def bitmask(self, matchers: list[Matcher]) -> torch.Tensor:
        """``[len(matchers), W]`` int32 on the CPU: each matcher's allowed next tokens (``Matcher.fill``)."""
        mask = torch.empty(len(matchers), self.words, dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.fill(mask[i])
        return mask


def _key(spec: StructuredOutputs) -> tuple:
    """``spec`` as a dictionary key (a JSON schema object as its JSON text, key order kept)."""
    kind = spec.kind
    value = getattr(spec, kind)
    if isinstance(value, dict):
        value = ("object", json.dumps(value, ensure_ascii=False))
    return kind, value, spec.disable_any_whitespace


def _unicode(text: str, field: str) -> None:
    """Refuse ``text`` (``structured_outputs.<field>``) if it cannot be sent as UTF-8.

    Raises:
        ValueError: ``text`` holds a lone surrogate (JSON's ``\\ud800`` escapes), named with the field, the text and
            the position.
    """
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        shown = repr(text) if len(text) <= 80 else repr(text[:77]) + "..."
        raise ValueError(f"structured_outputs.{field} {shown} is not valid Unicode text: a lone surrogate "
                         f"{text[exc.start]!r} at position {exc.start}") from None


def _one_line(message: str) -> str:
    """llguidance's multi-line diagnostics (the source excerpt, a caret) as one line, without the backtrace it
    appends to a panic (a limit of its grammar, for example more than 65,000 symbols)."""
    return " ".join(message.split("<backtrace>", 1)[0].split())


def _allowed(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, vocab]`` bool from ``words [N, W]`` int32 (``Matcher.fill``'s layout): token ``t`` allowed where bit
    ``t % 32`` of word ``t // 32`` is set."""
    t = torch.arange(vocab, device=words.device)
    return ((words[:, t // 32] >> (t % 32).to(torch.int32)) & 1).bool()


def allows_besides(row: torch.Tensor, tokens) -> bool:
    """Whether the bitmask ``row`` (``[W]`` int32 on the CPU, ``Matcher.fill``'s layout) allows a token not in
    ``tokens`` (token ids in ``[0, 32 * W)``)."""
    allowed = _allowed(row.unsqueeze(0), 32 * row.numel())[0]
    allowed[list(tokens)] = False
    return bool(allowed.any())


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """Ban, in place, every token of ``logits`` rows ``rows`` whose bit in ``mask`` is clear (logit ``-inf``).

    Args:
        logits: ``[N, V]`` float, on any device.
        rows: the rows constrained, one per row of ``mask``.
        mask: ``[len(rows), ceil(V / 32)]`` int32 on the CPU (``Grammars.bitmask``).
    """
    if not rows:
        return
    dev = logits.device
    allowed = _allowed(to_device(mask, dev), logits.shape[1])
    idx = to_device(rows, dev, torch.int64)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~allowed, float("-inf")))
