"""When a sequence stops, and the text it ends with (vLLM's rules): EOS and stop token ids once it has
``min_tokens``, stop strings past ``min_tokens``, a completed constraint, ``max_tokens`` and the context; the tokens
a sequence may not generate before ``min_tokens``."""

from __future__ import annotations

from epmoe.engine.request import Sequence


def banned_tokens(seq: Sequence, eos_ids: tuple[int, ...] | list[int], vocab_size: int) -> tuple[int, ...] | None:
    """The tokens ``seq`` may not generate next: its EOS (unless ``ignore_eos``) and stop token ids while it has
    fewer than ``min_tokens`` (vLLM's ``min_tokens``); ``None`` when none. The engine lifts the ban of a
    constrained row whose constraint allows no other token (as when it completes before ``min_tokens``).

    Args:
        seq: the sequence.
        eos_ids: the model's EOS token ids.
        vocab_size: ids at or past it are dropped.
    """
    p = seq.params
    if len(seq.output_token_ids) >= p.min_tokens:
        return None
    ids = tuple(t for t in p.stop_token_ids if 0 <= t < vocab_size)
    if not p.ignore_eos:
        ids += tuple(t for t in eos_ids if 0 <= t < vocab_size)
    return ids or None


def finish_reason(seq: Sequence, tok: int, eos_ids: tuple[int, ...] | list[int], tokenizer,
                  max_model_len: int) -> str | None:
    """Why ``seq`` stops after its newest read-back token ``tok``: ``stop``, ``length`` or ``abort`` (its
    constraint engine gave up; ``seq.error`` says why); ``None``: it goes on. Sets ``seq.stop_text_len`` where a
    stop string ends it and ``seq.constraint_done`` where its constraint does.

    Args:
        seq: the sequence, ``tok`` already in its output.
        tok: the token.
        eos_ids: the model's EOS token ids.
        tokenizer: decodes the output for stop strings (``None``: no stop strings are served).
        max_model_len: the context, tokens.
    """
    p = seq.params
    n = len(seq.output_token_ids) - seq.num_pending
    if seq.matcher is not None and seq.matcher.error is not None:  # its masks no longer held it: not a "stop"
        seq.error = (f"structured_outputs: the constraint engine (llguidance) gave up at output token {n}: "
                     f"{seq.matcher.error}")
        return "abort"
    if n >= p.min_tokens and ((tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
        return "stop"
    if p.stop and tokenizer is not None and n > p.min_tokens:  # vLLM: stop strings past min_tokens only
        text = tokenizer.decode(seq.resolved_output, skip_special_tokens=p.skip_special_tokens)
        hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
        if hits:
            seq.stop_text_len = min(hits)
            return "stop"
    if seq.matcher is not None and seq.matcher.stopped:  # the constraint is complete: only EOS could follow
        seq.constraint_done = tok not in eos_ids
        return "stop"
    if n >= p.max_tokens or len(seq.prompt_token_ids) + n >= max_model_len:
        return "length"
    return None


def final_text(seq: Sequence, tokenizer) -> str | None:
    """The text of a finished sequence's output (``None`` without a tokenizer): a stop or EOS token stays in the
    tokens, not in the text, and a stop string and what follows it are cut (vLLM's)."""
    if tokenizer is None:
        return None
    ids = seq.output_token_ids
    if seq.finish_reason == "stop" and seq.stop_text_len is None and not seq.constraint_done:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
    return text[: seq.stop_text_len] if seq.stop_text_len is not None else text
