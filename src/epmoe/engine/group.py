"""What a group of ranks must fit, checked before any rank starts: the expert placement (a file, or the trivial
one), the tensor-parallel sizes, the end-of-sequence ids, and a speculative-decoding draft model's own placement (an
EAGLE-3 head's sizes)."""

from __future__ import annotations

from epmoe.engine.capacity import check_kv_pool_room
from epmoe.engine.config import EngineConfig
from epmoe.engine.draft import draft_placement
from epmoe.engine.eagle3 import check_eagle3_fits
from epmoe.engine.tokenizer import eos_token_ids
from epmoe.integrations.placements import load_served_placement
from epmoe.layer import check_tp_sizes
from epmoe.placement import ExpertPlacement, check_redundant
from epmoe.spec import load_moe_spec, read_config


def trivial_or_file_placement(config: EngineConfig, num_layers: int, num_experts: int,
                              ep_size: int) -> ExpertPlacement:
    """The placement the options ask for: the file (epmoe's, SGLang's or TensorRT-LLM's), or the trivial one.

    Raises:
        ValueError: the placement does not fit the model or the group (named).
    """
    if config.placement:
        placement = load_served_placement(config.placement, ep_size=ep_size, spec=load_moe_spec(config.model))
    else:
        check_redundant(config.redundant, num_experts, ep_size, name="redundant")
        try:
            placement = ExpertPlacement.trivial(num_layers, num_experts, ep_size, config.redundant, config.layout)
        except ValueError as exc:
            raise ValueError(f"EP size {ep_size} with redundant {config.redundant}: {exc}") from None
    placement.check_model(num_layers, num_experts, what=f"model {config.model}")
    return placement


def check_group(config: EngineConfig, size: int) -> None:
    """What a group of ``size`` ranks must fit, checked before any rank starts (``epmoe run`` and ``epmoe serve``
    call it, so a bad placement is named before a process loads a weight): under ``tp`` the sizes the group must
    divide; under ``ep`` the target's placement (the file, or the trivial one of ``redundant``); an MoE draft
    model's placement (``speculative_draft_placement``, or the draft's trivial one), which the draft would
    otherwise meet only as it loads inside the ranks, and an EAGLE-3 head's hidden and vocabulary sizes
    (``eagle3.check_eagle3_fits``); the end-of-sequence ids of ``config.json`` and ``generation_config.json``
    (``tokenizer.eos_token_ids``); and a ``num_kv_blocks`` pool the memory could not hold
    (``capacity.check_kv_pool_room``).

    Raises:
        ValueError: the first misfit (a placement file missing too), its message prefixed with the flags that
            chose it (``--placement FILE with --ep N``, ``--speculative-draft-placement FILE with --ep N``); a KV pool
            past the memory (``check_kv_pool_room``); an end-of-sequence id outside the vocabulary or not a token id
            (the file named); an EAGLE-3 head of another hidden or vocabulary size than the target's.
    """
    check_kv_pool_room(config, size)
    spec = load_moe_spec(config.model)
    eos_token_ids(config.model, None, config.generation_config, spec.vocab_size)
    try:
        if config.parallel == "tp":
            check_tp_sizes(spec, size)
        else:
            trivial_or_file_placement(config, spec.num_moe_layers, spec.num_experts, size)
    except (ValueError, FileNotFoundError) as exc:
        chosen = f"--placement {config.placement} with --ep {size}" if config.placement else f"--ep {size}"
        raise ValueError(f"{chosen}: {exc}") from None
    if config.speculative_draft_model is None:
        return
    if config.speculative_algorithm == "eagle3":
        draft = str(config.speculative_draft_model)
        # the head's config.json as the head reads it (``eagle3.Eagle3Proposer``): its own fields, not a text_config's
        check_eagle3_fits(read_config(draft)[0], f"--speculative-draft-model {draft}", config.model,
                          spec.hidden_size, spec.vocab_size)
    try:
        draft_placement(config, size)
    except (ValueError, FileNotFoundError) as exc:
        chosen = (f"--speculative-draft-placement {config.speculative_draft_placement}"
                  if config.speculative_draft_placement else
                  f"--speculative-draft-model {config.speculative_draft_model}")
        raise ValueError(f"{chosen} with --ep {size}: {exc}") from None
