"""The one checker of ``config.json`` fields: every field a model config is read for goes through ``ConfigFields``.

A field is looked up under its name and its aliases; a field that is absent takes the default that transformers'
own config class of the model type declares (read from the class, never copied by hand), and the fields so
filled are remembered (``ConfigFields.defaulted``) so ``plan`` and ``doctor`` can say which values came from
defaults. An explicit ``null`` means what transformers makes of it: the value derived from other fields where
the reader gives that rule (``q_lora_rank: null`` is no query LoRA), else the default. A value of the wrong
type (a string for a number, ``true`` for a count) or outside its range raises ``ValueError`` naming the file,
the field and the value, the value as JSON writes it (``true``, ``null``, ``"3"``). A nested object
(``rope_parameters``) is read through ``ConfigFields.section``, its fields named by their path
(``rope_parameters.rope_type``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from functools import lru_cache
from typing import Any, Iterable

from epmoe.checks import is_int


def json_text(value: Any) -> str:
    """``value`` as it reads in a JSON file (``true``, ``null``, ``"fp8"``), for messages about ``config.json``
    fields; ``repr`` for what JSON cannot hold."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)


# model types transformers does not register, built as the architecture they are (as ``models.hf.hf_config``)
_CONFIG_CLASS_OF = {"kimi_k2": "deepseek_v3"}


@lru_cache(maxsize=None)
def transformers_defaults(model_type: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The field defaults transformers declares for ``model_type``'s config class.

    Read from the class itself: the dataclass fields of transformers 5.x configs, or the keyword defaults of
    ``__init__`` for a class that is not a dataclass. ``None`` defaults (fields transformers derives from others,
    such as ``head_dim``) are left out.

    Returns:
        The class name (``""`` when transformers has no config class for the type), ``{field: default}``, and
        the class's ``attribute_map`` (alias -> field).
    """
    from transformers import CONFIG_MAPPING

    name = _CONFIG_CLASS_OF.get(model_type, model_type)
    if name not in CONFIG_MAPPING:
        return "", {}, {}
    cls = CONFIG_MAPPING[name]
    if dataclasses.is_dataclass(cls):
        declared = {f.name: f.default for f in dataclasses.fields(cls)}
    else:
        declared = {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()}
    defaults = {k: v for k, v in declared.items()
                if v is not None and v is not dataclasses.MISSING and v is not inspect.Parameter.empty}
    return cls.__name__, defaults, dict(getattr(cls, "attribute_map", {}) or {})


@lru_cache(maxsize=None)
def transformers_rope_types() -> tuple[str, ...]:
    """The ``rope_type`` values transformers' rotary embeddings compute: ``default`` and the keys of its
    ``ROPE_INIT_FUNCTIONS`` (read from transformers, never copied by hand)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ("default", *ROPE_INIT_FUNCTIONS)


_MISSING = object()


class ConfigFields:
    """Typed, range-checked reads of one config dict, with transformers' defaults for absent fields.

    Args:
        cfg: the JSON object of a ``config.json`` (the language-model part).
        source: the file it came from, named in every message.
        model_type: selects transformers' config class whose defaults fill absent fields; ``None`` = no
            defaults (every absent field without a fallback is missing).
        prefix: put before every field name in messages: the path of a nested object (``rope_parameters.``), as
            ``section`` sets it.

    Attributes:
        defaulted: ``{field: value}`` of the fields taken from transformers' defaults, in reading order.
        defaults_class: the name of the transformers config class the defaults came from (``""`` if none).
    """

    def __init__(self, cfg: dict[str, Any], source: str, model_type: str | None = None, prefix: str = "") -> None:
        self.cfg = cfg
        self.source = source
        self.model_type = model_type
        self.prefix = prefix
        self.defaulted: dict[str, Any] = {}
        self.defaults_class = ""

    def _lookup(self, key: str, alternatives: Iterable[str], fallback: Any) -> tuple[str, Any]:
        """``(the field's name as messages give it, its value)``: the first name present, else the default.

        Besides ``key`` and ``alternatives``, the names transformers' config class maps to the same field
        (its ``attribute_map``) are looked up, as transformers reads them (Mixtral's ``num_experts`` is its
        ``num_local_experts``)."""
        names = asked = (key, *alternatives)
        if self.model_type is not None:
            aliases = transformers_defaults(self.model_type)[2]
            fields = {aliases.get(k, k) for k in names}
            names = tuple(dict.fromkeys((*names, *fields, *(a for a, f in aliases.items() if f in fields))))
        for k in names:
            if self.cfg.get(k) is not None:
                return self.prefix + k, self.cfg[k]
        nulls = [k for k in names if k in self.cfg]
        if nulls and fallback is not _MISSING:
            # an explicit null: transformers derives the value (``q_lora_rank: null``: none)
            return self.prefix + key, fallback
        if nulls:  # transformers' config keeps a null it has no rule for: not its default
            _, declared, aliases = (transformers_defaults(self.model_type) if self.model_type is not None
                                    else ("", {}, {}))
            has_default = any(aliases.get(k, k) in declared for k in names)
            raise ValueError(f"{self.source}: field {self.prefix + nulls[0]!r} is null in config.json; give its value"
                             + (" or leave it out for transformers' default" if has_default else ""))
        if self.model_type is not None:
            cls, defaults, aliases = transformers_defaults(self.model_type)
            for k in names:
                field = aliases.get(k, k)
                if field in defaults:
                    self.defaults_class = cls
                    self.defaulted[key] = defaults[field]
                    return self.prefix + key, defaults[field]
        if fallback is not _MISSING:
            return self.prefix + key, fallback
        wanted = " or ".join(repr(self.prefix + k) for k in asked)
        where = f" (and transformers' {self.model_type} config declares no default)" if self.model_type else ""
        raise ValueError(f"{self.source}: missing field {wanted} in config.json{where}")

    def _fail(self, key: str, value: Any, expected: str) -> ValueError:
        kind = " (a string)" if isinstance(value, str) else ""
        return ValueError(f"{self.source}: field {key!r} must be {expected}, got {json_text(value)}{kind}")

    def has(self, key: str) -> bool:
        """True when the config itself holds a non-null ``key``."""
        return self.cfg.get(key) is not None

    def section(self, key: str, *alternatives: str) -> ConfigFields | None:
        """The JSON object under ``key`` (or the first of ``alternatives`` present) as fields of its own, named by
        their path in messages (``rope_parameters.rope_type``); ``None`` when the config has none (absent or
        ``null``). Its absent fields take only the reader's ``fallback``: transformers declares no defaults inside.

        Raises:
            ValueError: the value is not a JSON object (file, field and value named).
        """
        for k in (key, *alternatives):
            if self.has(k):
                if not isinstance(self.cfg[k], dict):
                    raise self._fail(self.prefix + k, self.cfg[k], "a JSON object")
                return ConfigFields(self.cfg[k], self.source, prefix=f"{self.prefix}{k}.")
        return None

    def int(self, key: str, *alternatives: str, minimum: int = 1, maximum: int | None = None,
            fallback: Any = _MISSING) -> int:
        """An integer field in ``[minimum, maximum]`` (``true``/``false``, floats and strings refused).

        Args:
            key: the field; ``alternatives``: other names it goes by (the first present wins).
            minimum, maximum: the accepted range (``maximum`` ``None`` = unbounded).
            fallback: the value when the field is absent and transformers declares no default (a rule
                transformers derives, such as ``head_dim = hidden_size // num_attention_heads``).

        Raises:
            ValueError: missing, of the wrong type, or out of range (file, field and value named).
        """
        k, v = self._lookup(key, alternatives, fallback)
        if maximum is not None and minimum > maximum:
            raise ValueError(f"{self.source}: field {k!r} must lie in [{minimum}, {maximum}], an empty range")
        if not is_int(v) or v < minimum or (maximum is not None and v > maximum):
            expected = ("a positive integer" if minimum == 1 else f"an integer >= {minimum}") if maximum is None \
                else f"an integer in [{minimum}, {maximum}]"
            raise self._fail(k, v, expected)
        return int(v)

    def float(self, key: str, *alternatives: str, minimum: float | None = None, positive: bool = False,
              fallback: Any = _MISSING) -> float:
        """A finite number field (an integer is accepted), ``> 0`` with ``positive``, ``>= minimum`` with
        ``minimum``.

        Raises:
            ValueError: missing, not a number, not finite, or out of range (file, field and value named).
        """
        k, v = self._lookup(key, alternatives, fallback)
        number = (is_int(v) or isinstance(v, float)) and math.isfinite(v)
        if not number or (positive and v <= 0) or (minimum is not None and v < minimum):
            expected = "a positive number" if positive else (
                f"a number >= {minimum:g}" if minimum is not None else "a finite number")
            raise self._fail(k, v, expected)
        return float(v)

    def bool(self, key: str, *alternatives: str, fallback: Any = _MISSING) -> bool:
        """A ``true``/``false`` field.

        Raises:
            ValueError: missing or not a boolean (file, field and value named).
        """
        k, v = self._lookup(key, alternatives, fallback)
        if not isinstance(v, bool):
            raise self._fail(k, v, "true or false")
        return v

    def str(self, key: str, *alternatives: str, choices: Iterable[str] | None = None,
            fallback: Any = _MISSING) -> str:
        """A string field, one of ``choices`` when given.

        Raises:
            ValueError: missing, not a string, or not one of ``choices`` (file, field and value named).
        """
        k, v = self._lookup(key, alternatives, fallback)
        allowed = None if choices is None else tuple(choices)
        if not isinstance(v, str) or (allowed is not None and v not in allowed):
            raise self._fail(k, v, "a string" if allowed is None else "one of " + ", ".join(map(json_text, allowed)))
        return v

    def int_list(self, key: str, *alternatives: str, minimum: int = 0, maximum: int | None = None,
                 fallback: Any = _MISSING) -> list[int]:
        """A list of integers, each in ``[minimum, maximum]``.

        Raises:
            ValueError: missing, not a list, or an element of the wrong type or range (its position named).
        """
        k, v = self._lookup(key, alternatives, fallback)
        if not isinstance(v, list):
            raise self._fail(k, v, "a list of integers")
        for i, item in enumerate(v):
            if not is_int(item) or item < minimum or (maximum is not None and item > maximum):
                rng = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
                kind = " (a string)" if isinstance(item, str) else ""
                raise ValueError(f"{self.source}: field {k!r}[{i}] must be an integer {rng}, "
                                 f"got {json_text(item)}{kind}")
        return [int(i) for i in v]
