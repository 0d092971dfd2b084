"""Continuous batching: which sequences run at each step, with how many tokens, in which KV blocks.

Each step the scheduler walks the running sequences in arrival order and gives each the tokens it has
not computed yet (one for a decode, the rest of a prompt, or a chunk of it: chunked prefill), within a
token budget (``max_num_batched_tokens``), then admits waiting sequences while the budget, the
sequence limit (``max_num_seqs``) and the free KV blocks allow. When a running sequence needs a block
and none is free, the most recently admitted running sequence is preempted: its blocks are freed and
it goes back to the waiting queue, to be recomputed from its tokens later (vLLM's recompute
preemption). Nothing is ever dropped: a sequence that cannot fit even alone in the whole pool is
finished with reason ``length``.

With graph steps (``graph_rows`` > 0), a prompt chunk that ends within ``graph_tokens`` runs as single-token
rows next to the decodes in a replayed CUDA graph of at most ``graph_rows`` rows; such chunks are cut (or
wait) so that the step's rows stay within ``graph_rows`` as long as no longer chunk makes the step eager
anyway: a burst of short prompts joins the running decodes a bucket at a time, rather than turning one
step into an eager one (bound by the host's launches) that every running sequence waits for. Where the
decodes alone fill ``graph_rows``, no graph step could take a prompt before one of them finishes: the
prompts go in and the step runs eagerly, so graph steps never hold the running sequences below
``max_num_seqs``.

With the engine's overlap schedule, a sequence's newest token may still be on the device when the next step
is planned (``Sequence.num_pending``): it is planned as known (the step reads it on the device), except where
that token is the sequence's last by length (``max_tokens`` or the context): such a sequence is not fed again,
its blocks are freed at once and it no longer counts against ``max_num_seqs`` (the engine finishes it when the
token is read back). A sequence with a token on the device that needs a block none is free for waits a step
instead of preempting anyone: that token may end it.

With speculative decoding (``lookahead`` K > 0), a decoding sequence also gets the budget and the KV blocks
of up to K proposed tokens after its last one (vLLM's lookahead slots), as far as its ``max_tokens`` and
the context allow; when the blocks are short it decodes without them rather than preempt anyone.

With prefix caching (``prefix_caching``), every full block a sequence has computed (its tokens all known on the
host) is put in the allocator's prefix cache under its key (``kv_cache.block_key``: the block's tokens after its
parent's key), and stays there after the sequence frees it until the blocks are needed. A sequence admitted with
nothing computed (new, or preempted) takes the longest run of cached blocks matching its tokens, as far as the
block before its last token (the last token is always fed: its logits sample the next), and starts computing
after them; a request asking for its prompt's log-probabilities takes none (they need every prompt row's logits).
A preempted sequence so finds its own blocks again while no one has taken them. A sequence's
``num_cached_tokens`` is what its first admission took from the cache (a re-admission after preemption leaves it).
"""

from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from epmoe.engine.kv_cache import BlockAllocator, BlockKey, block_key
from epmoe.engine.request import Sequence, SequenceStatus


class ScheduledChunk(NamedTuple):
    """Tokens ``[start, start + num_tokens)`` of ``seq`` fed at this step (a tuple: many are made per step),
    and room (budget and KV blocks) for ``lookahead`` proposed tokens after them (decodes only)."""

    seq: Sequence
    start: int
    num_tokens: int
    lookahead: int = 0

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token: the step samples its next token."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def prefill_logit_rows(self) -> int:
        """How many of its last rows return logits when fed as a prefill chunk: every row while its request still
        needs the log-probabilities of prompt tokens (``SamplingParams.prompt_logprobs``) and the chunk predicts
        one (row ``p`` predicts token ``p + 1``), else its last row if it samples, else none."""
        seq = self.seq
        n = len(seq.prompt_token_ids)
        if seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < n and self.start + 1 < n:
            return self.num_tokens
        return int(self.samples)


@dataclass(frozen=True)
class StepPlan:
    """One step of one rank.

    Attributes:
        decodes: single-token chunks that sample (packed first; they use the decode attention kernel and
            may replay a CUDA graph, which returns the logits of every decode row).
        prefills: the other chunks (several tokens, or one token of a prompt cut by the token budget that
            does not sample), in order after the decodes.
        preempted: sequences preempted while planning this step.
        finished: sequences finished by the scheduler (too long for the whole KV pool).
        rowwise_prefills: the scheduler has graph steps (``graph_rows`` > 0) and every prefill chunk ends within
            ``graph_tokens``: the prompts may run as single-token rows in a graph step.
    """

    decodes: tuple[ScheduledChunk, ...] = ()
    prefills: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    finished: tuple[Sequence, ...] = ()
    rowwise_prefills: bool = False

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        """Every chunk in packing order."""
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        """Tokens fed at this step."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling(self) -> list[ScheduledChunk]:
        """Chunks whose sequence samples a token at this step, in packing order."""
        return [c for c in self.chunks if c.samples]

    @property
    def sampling_rows(self) -> list[int]:
        """Packed row of each sampling chunk's last token."""
        rows, row = [], 0
        for c in self.chunks:
            row += c.num_tokens
            if c.samples:
                rows.append(row - 1)
        return rows


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class Scheduler:
    """Continuous-batching scheduler of one rank.

    Args:
        allocator: the KV block free list.
        block_size: tokens per KV block.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens fed in one step.
        lookahead: ``K`` proposed tokens a decoding sequence may verify per step (0 = no speculation).
        max_model_len: the context (proposals never run past it, pending tokens at it are not fed again);
            needed with ``lookahead``.
        graph_tokens: prompt chunks ending within this many tokens run row-wise in graph steps.
        graph_rows: rows of the largest graph step (0 = no graph steps: prompt chunks are not cut for them).
        prefix_caching: share computed full blocks through the allocator's prefix cache (module docstring).

    Attributes:
        prefix_queries, prefix_hits: with prefix caching, tokens of the sequences admitted with nothing computed,
            and of those the ones found in the cache (vLLM's prefix-cache queries and hits).

    Raises:
        ValueError: a size that is not a positive integer, or ``max_num_batched_tokens < max_num_seqs``
            (every running sequence must be able to decode in one step).
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, lookahead: int = 0, max_model_len: int | None = None,
                 graph_tokens: int = 0, graph_rows: int = 0, prefix_caching: bool = False) -> None:
        self.allocator = allocator
        self.block_size = _check_positive("block_size", block_size)
        self.max_num_seqs = _check_positive("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _check_positive("max_num_batched_tokens", max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({max_num_seqs}): every running sequence decodes one token per step")
        if lookahead and max_model_len is None:
            raise ValueError("a scheduler with lookahead needs max_model_len")
        self.lookahead = int(lookahead)
        self.max_model_len = max_model_len
        self.graph_tokens = int(graph_tokens)
        self.graph_rows = int(graph_rows)
        self.prefix_caching = bool(prefix_caching)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, end: int) -> int:
        return max(0, -(-end // self.block_size) - len(seq.block_table))

    def _lookahead(self, seq: Sequence, n: int, budget: int) -> int:
        """Proposed tokens ``seq`` may verify after its ``n`` tokens of this step."""
        if not self.lookahead or n != 1 or seq.num_computed + 1 != seq.num_tokens:
            return 0
        left = seq.params.max_tokens - len(seq.output_token_ids) - 1
        k = min(self.lookahead, left, self.max_model_len - seq.num_tokens, budget - 1)
        if k > 0 and self._blocks_needed(seq, seq.num_tokens + k) > self.allocator.num_free:
            return 0
        return max(0, k)

    def _ends_pending(self, seq: Sequence) -> bool:
        """True when ``seq``'s pending token (still on the device) is its last by length (``max_tokens`` or the
        context): it is not fed again, and the engine finishes it once the token is read back."""
        if not seq.num_pending:
            return False
        full = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        return full or len(seq.output_token_ids) >= seq.params.max_tokens

    def _release(self, seq: Sequence) -> None:
        self._register(seq)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_registered = 0

    def _keys(self, seq: Sequence, n: int) -> list[BlockKey]:
        """``seq.block_keys``, holding at least the prefix-cache keys of its first ``n`` full blocks (their tokens
        known on the host)."""
        bs = self.block_size
        keys = seq.block_keys
        while len(keys) < n:
            i = len(keys)
            keys.append(block_key(keys[-1] if i else None, seq.tokens(i * bs, (i + 1) * bs)))
        return keys

    def _known(self, seq: Sequence) -> int:
        """Leading tokens of ``seq`` whose ids are on the host (its pending tokens are not)."""
        return seq.num_tokens - seq.num_pending

    def _register(self, seq: Sequence) -> None:
        """Put ``seq``'s computed full blocks whose tokens are known in the prefix cache (with prefix caching)."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed, self._known(seq), len(seq.block_table) * self.block_size) // self.block_size
        if full > seq.num_registered:
            keys = self._keys(seq, full)
            for i in range(seq.num_registered, full):
                self.allocator.register(seq.block_table[i], keys[i])
            seq.num_registered = full

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a sequence admitted with nothing computed starts from (with prefix caching)."""
        if not self.prefix_caching or seq.num_computed or seq.params.prompt_logprobs is not None:
            return []
        limit = min(seq.num_tokens - 1, self._known(seq)) // self.block_size
        return self.allocator.cached(self._keys(seq, limit)[:limit])

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        # back in arrival order at the head of the queue
        pos = 0
        while pos < len(self.waiting) and self.waiting[pos].arrival < seq.arrival:
            pos += 1
        self.waiting.insert(pos, seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished with ``reason`` and free its blocks (it leaves every queue)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _graph_cut(self, seq: Sequence, n: int, rows: int, eager: bool, prompt_rows: int) -> tuple[int, int, bool]:
        """``(n', rows', eager')``: the tokens of ``seq``'s next prompt chunk of up to ``n`` in this step (0 = it
        waits), the step's single-token rows and whether a chunk already makes the step eager, after it.
        ``prompt_rows``: the step's rows of prompt chunks so far. A chunk waits for room only behind other prompt
        rows: where decodes alone fill the largest graph step, none could take it before one of them finishes, so
        it goes in and the step runs eagerly (graph steps never hold the running sequences below
        ``max_num_seqs``)."""
        if n == 1 and seq.num_computed + 1 == seq.num_tokens:  # a decode: one row, never cut
            return n, rows + 1, eager
        if not self.graph_rows or eager:
            return n, rows, eager
        if seq.num_computed + n > self.graph_tokens:  # too long for a graph step: this step runs eagerly
            return n, rows, True
        if rows >= self.graph_rows and not prompt_rows:  # decodes fill the largest graph step: this one runs eagerly
            return n, rows, True
        n = min(n, self.graph_rows - rows) if rows else n
        return max(n, 0), rows + max(n, 0), eager

    def schedule(self) -> StepPlan:
        """Plan the next step (see the module docstring)."""
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        finished: list[Sequence] = []
        for seq in self.running:
            self._register(seq)
        ending = [s for s in self.running if self._ends_pending(s)]
        for seq in ending:  # never fed again: the blocks go back now (steps run in order on the device)
            self._release(seq)
        ending_ids = {id(s) for s in ending}
        queue = deque(s for s in self.running if id(s) not in ending_ids)
        kept: list[Sequence] = []
        rows, eager, prompt_rows = 0, False, 0
        while queue:
            seq = queue.popleft()
            n = min(seq.num_tokens - seq.num_computed, budget)
            decode = seq.num_computed + 1 == seq.num_tokens
            n, rows, eager = self._graph_cut(seq, n, rows, eager, prompt_rows)
            prompt_rows += 0 if decode else n
            if n == 0:
                kept.append(seq)
                continue
            ahead = self._lookahead(seq, n, budget)
            rows += ahead
            need = self._blocks_needed(seq, seq.num_computed + n + ahead)
            if seq.num_pending and self.allocator.num_free < need:
                # its token on the device may be a stop: it waits for that rather than evict anyone
                kept.append(seq)
                continue
            while self.allocator.num_free < need and queue:
                victim = queue.pop()
                self._preempt(victim)
                preempted.append(victim)
            if self.allocator.num_free < need:
                if kept:
                    self._preempt(seq)
                    preempted.append(seq)
                else:  # alone and still too long for the whole pool
                    self.finish(seq, "length")
                    finished.append(seq)
                continue
            seq.block_table.extend(self.allocator.allocate(need))
            chunk = ScheduledChunk(seq, seq.num_computed, n, ahead)
            (decodes if chunk.samples and n == 1 else prefills).append(chunk)
            budget -= n + ahead
            kept.append(seq)
        stay = ending_ids | {id(s) for s in kept}
        self.running = [s for s in self.running if id(s) in stay]  # in arrival order
        while self.waiting and not preempted and budget > 0 and len(self.running) - len(ending) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            seq.num_computed = len(hits) * self.block_size  # what _graph_cut plans from (0 again if it waits)
            n, rows_after, eager_after = self._graph_cut(seq, min(seq.num_tokens - seq.num_computed, budget), rows,
                                                         eager, prompt_rows)
            need = self._blocks_needed(seq, seq.num_computed + n) - len(hits)
            if n == 0 or need + self.allocator.num_revived(hits) > self.allocator.num_free:
                seq.num_computed = 0
                if n and not self.running and need > self.allocator.capacity:
                    self.waiting.popleft()
                    self.finish(seq, "length")
                    finished.append(seq)
                    continue
                break
            self.waiting.popleft()
            if self.prefix_caching:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += seq.num_computed
                if not seq.num_preemptions:  # what the request was served: its first admission's
                    seq.num_cached_tokens = seq.num_computed
            self.allocator.acquire(hits)
            seq.block_table.extend(hits)
            seq.num_registered = len(hits)
            rows, eager = rows_after, eager_after
            prompt_rows += 0 if seq.num_computed + 1 == seq.num_tokens else n
            seq.block_table.extend(self.allocator.allocate(need))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = ScheduledChunk(seq, seq.num_computed, n)
            (decodes if chunk.samples and n == 1 else prefills).append(chunk)
            budget -= n
        rowwise = self.graph_rows > 0 and all(c.start + c.num_tokens <= self.graph_tokens for c in prefills)
        return StepPlan(tuple(decodes), tuple(prefills), tuple(preempted), tuple(finished), rowwise)
