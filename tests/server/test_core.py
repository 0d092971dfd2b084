"""The engine core's start-up check: a rank's KV pool must hold one sequence of the whole context."""

from __future__ import annotations

import pytest

from epmoe.engine import Engine
from epmoe.models.tiny import ensure_default_checkpoint
from epmoe.server.config import ServeConfig
from epmoe.server.core import check_kv_holds_context


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_default_checkpoint())


def _check(model_dir: str, **options) -> None:
    cfg = ServeConfig(**options)
    engine = Engine(cfg.engine_config(model_dir))
    kv = engine.kv_report()
    check_kv_holds_context(engine.max_model_len, kv["blocks"], kv["block_size"], cfg)


def test_pool_short_of_the_models_context_is_refused_naming_both(model_dir):
    # 16 blocks of 16 tokens, one the padding block: 240 tokens, against the built-in model's context of 256
    with pytest.raises(ValueError) as err:
        _check(model_dir, num_kv_blocks=16)
    assert str(err.value) == (
        "the model's max seq len (256 tokens, the model's context; --max-model-len not given) is larger than the "
        "maximum number of tokens that can be stored in the KV cache (240: 15 blocks of 16 besides the padding "
        "block); try increasing --num-kv-blocks (now 16) to at least 17 or decreasing --max-model-len")


def test_pool_of_exactly_the_context_is_taken(model_dir):
    _check(model_dir, num_kv_blocks=17)
    _check(model_dir, num_kv_blocks=16, max_model_len=240)
    with pytest.raises(ValueError, match=r"max seq len \(241 tokens, --max-model-len\) .* KV cache \(240: "):
        _check(model_dir, num_kv_blocks=16, max_model_len=241)
