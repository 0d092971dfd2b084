"""``ngram``: prompt-lookup speculation (no weights).

The last ``n`` tokens of a request (prompt and output) are looked up earlier in the same tokens, for ``n``
from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (vLLM's names); at the longest ``n`` that matches, the
most recent earlier occurrence wins, and the tokens that followed it are proposed (Saxena 2023, "Prompt
Lookup Decoding"; vLLM's ``ngram`` method). Proposals are deterministic: ``q`` is one-hot in verification.
"""

from __future__ import annotations

import numpy as np

from epmoe.engine.speculative import Proposal, Proposer


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The continuation of the longest earlier match of the last tokens.

    Args:
        tokens: the request's tokens so far (prompt then output).
        k: most tokens proposed.
        min_n, max_n: shortest and longest suffix matched.

    Returns:
        Up to ``k`` token ids (``[]`` when no suffix of ``min_n`` or more tokens occurs earlier).
    """
    n_tok = len(tokens)
    if k < 1 or n_tok < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = arr[n_tok - n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)  # starts 0 .. n_tok - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent match
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt lookup over each request's own tokens.

    Args:
        min_n, max_n: ``prompt_lookup_min`` and ``prompt_lookup_max``.
    """

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def describe(self) -> str:
        """The n-gram range."""
        return f"ngram: prompt lookup, n-grams of {self.min_n} to {self.max_n} tokens (no draft weights)"

    def propose(self, chunks: list, limits: list[int], engine) -> list[Proposal]:
        """Each chunk's sequence's continuation of its longest earlier n-gram match (``ngram_propose``)."""
        out = []
        for c, limit in zip(chunks, limits):
            seq = c.seq
            ids = ngram_propose(seq.prompt_token_ids + seq.output_token_ids, limit, self.min_n, self.max_n)
            out.append(Proposal(tuple(ids)))
        return out
