"""What the engine checks of a request before it queues one, and the compiler of structured outputs' constraints.

``Admission`` holds what those checks need (the tokenizer, the vocabulary, the context and the KV pool's size, whether
speculative decoding runs) and the ``Grammars`` built on the first constrained request. ``Engine.add_request`` and
``Engine.check_request`` run its ``check``; the server compiles constraints through it in a worker thread
(``compile_constraint``), so that a large grammar does not hold up the steps.
"""

from __future__ import annotations

import numbers
import threading

from epmoe.engine.sampling import SamplingParams
from epmoe.engine.structured import Grammars, Matcher, StructuredOutputs
from epmoe.engine.tokenizer import encode_text


class Admission:
    """A rank's request checks (nothing is queued by them) and its structured outputs' compiler.

    Args:
        tokenizer: the model's tokenizer (``engine.tokenizer.load_tokenizer``; ``None`` where the checkpoint has
            none: text is then encoded as its UTF-8 bytes).
        vocab_size: the model's vocabulary (token ids are ``0 .. vocab_size - 1``).
        eos_ids: the end-of-sequence token ids (where a constraint may end).
        max_model_len: the context, in tokens.
        pool_blocks: KV blocks a request may hold (the pool's, less the padding rows' block); block_size: tokens a
            block.
        speculative_algorithm: the engine's speculative decoding, or ``None``: with one, penalties, logit bias and
            structured outputs are refused (its verification neither adjusts the logits nor constrains the
            proposals).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], max_model_len: int, pool_blocks: int,
                 block_size: int, speculative_algorithm: str | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.pool_blocks = pool_blocks
        self.block_size = block_size
        self.speculative_algorithm = speculative_algorithm
        self.grammars: Grammars | None = None  # built on the first constrained request
        self._lock = threading.Lock()

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string through the tokenizer, or ids as given).

        Raises:
            TypeError: a prompt that is neither a string nor a list/tuple of token ids.
            ValueError: an empty prompt, or ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = encode_text(self.tokenizer, self.vocab_size, prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must have at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return [int(t) for t in ids]

    def check(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], Matcher | None]:
        """The prompt's token ids and the request's constraint matcher (``None`` without one), if the request can be
        served; nothing is queued.

        Raises:
            TypeError: ``params`` is not a ``SamplingParams``; a prompt of another type.
            ValueError: an empty prompt, prompt, stop or logit-bias token ids outside the vocabulary, a penalty,
                logit bias or structured output with speculative decoding, structured outputs without a tokenizer
                or that do not compile, a prompt as long as the context (``max_model_len``), or a prompt whose keys
                and values with ``max_tokens`` more would not fit in the whole KV pool (it could only be cut
                short).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}) (the vocabulary), got {bad[:5]}")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}) (the vocabulary), got {bad[:5]}")
        if params.adjusts_logits and self.speculative_algorithm is not None:
            name = next(n for n in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
                        if getattr(params, n) != SamplingParams.__dataclass_fields__[n].default)
            raise ValueError(f"{name} is not served with speculative decoding (speculative_algorithm "
                             f"{self.speculative_algorithm!r}): its verification does not adjust the logits")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the context of max_model_len "
                             f"{self.max_model_len} tokens")
        pool = self.pool_blocks * self.block_size
        # the last token sampled is never fed back: its KV is not needed
        need = min(len(ids) + params.max_tokens - 1, self.max_model_len)
        if len(ids) > pool:
            raise ValueError(f"prompt of {len(ids)} tokens needs as many KV slots; the KV pool holds {pool} tokens "
                             f"({self.pool_blocks} blocks of {self.block_size}): give the cache more blocks")
        if need > pool:
            raise ValueError(f"prompt of {len(ids)} tokens with max_tokens {params.max_tokens} needs {need} KV slots; "
                             f"the KV pool holds {pool} tokens ({self.pool_blocks} "
                             f"block{'s' if self.pool_blocks != 1 else ''} of "
                             f"{self.block_size}): lower max_tokens or give the cache more blocks")
        so = params.structured_outputs
        return ids, self.compiler().matcher(so) if so is not None else None

    def constraint_ready(self, spec: StructuredOutputs) -> bool:
        """Whether a request with ``spec`` would find its grammar compiled (and so not compile it in the caller's
        thread)."""
        return self.grammars is not None and self.grammars.is_compiled(spec)

    def compile_constraint(self, spec: StructuredOutputs) -> None:
        """Compile ``spec``'s grammar into the cache of compiled grammars, so that a request with it soon after
        copies it instead of compiling. Safe to run in another thread than the one that steps (llguidance compiles
        without the interpreter lock).

        Raises:
            ValueError: as ``check`` for this constraint (it does not compile; speculative decoding; no tokenizer).
        """
        self.compiler().matcher(spec)

    def compiler(self) -> Grammars:
        """The compiler of structured outputs' constraints (built on first use).

        Raises:
            ValueError: speculative decoding (its verification does not constrain the proposals), no tokenizer.
        """
        if self.speculative_algorithm is not None:
            raise ValueError(f"structured_outputs are not served with speculative decoding (speculative_algorithm "
                             f"{self.speculative_algorithm!r}): its verification does not constrain the "
                             f"proposals")
        with self._lock:  # compile_constraint may build it in a worker thread
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        return self.grammars
