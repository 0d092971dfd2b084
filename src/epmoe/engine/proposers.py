"""The proposers of speculative decoding by algorithm name (``ngram``, ``draft``, ``eagle3``)."""

from __future__ import annotations

from epmoe.engine.speculative import Proposer


def make_proposer(engine) -> Proposer:
    """The proposer of ``engine.config.speculative_algorithm`` for ``engine`` (its target model loaded).

    Raises:
        ValueError: a draft that does not fit the target or its own placement (the draft named).
    """
    cfg = engine.config
    if cfg.speculative_algorithm == "ngram":
        from epmoe.engine.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.speculative_algorithm == "draft":
        from epmoe.engine.draft import DraftModelProposer

        return DraftModelProposer(engine)
    from epmoe.engine.eagle3 import Eagle3Proposer

    return Eagle3Proposer(engine)
