"""A checkpoint's tokenizer, text to token ids and back without one, and its end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from epmoe.checks import check_regular_file, read_text_file
from epmoe.config_fields import json_text
from epmoe.spec import language_model_config, read_config


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or ``None`` when it has none (prompts are then UTF-8 bytes).

    Args:
        model_dir: the checkpoint directory.
        trust_remote_code: run a tokenizer class that ships as code with the checkpoint (``tokenizer_config.json``'s
            ``auto_map``, a class transformers does not have: Kimi-K2's ``TikTokenTokenizer``).

    Raises:
        ValueError: the tokenizer is code shipped with the checkpoint and ``trust_remote_code`` is false (its file
            named; transformers would ask on the terminal); an ``auto_map`` that names no class of the checkpoint's
            own files; the tokenizer files cannot be read (the broken JSON file named, with the parser's reason, or
            one that is not a JSON object), or
            a ``tokenizer_config.json`` without any vocabulary file beside it; a tokenizer file that is not a
            regular file (a pipe or a device: ``checks.check_regular_file``).
    """
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    for name in (*names, "special_tokens_map.json"):  # a pipe would block transformers' read, a device fill memory
        if (Path(model_dir) / name).exists():
            check_regular_file(Path(model_dir) / name, "tokenizer file")
    if not any((Path(model_dir) / f).is_file() for f in names):
        return None
    import json

    from transformers import AutoTokenizer

    remote = remote_tokenizer(model_dir)
    if remote is not None and not trust_remote_code:
        raise ValueError(f"the tokenizer of {model_dir!r} is code shipped with the checkpoint ({remote}): set "
                         f"trust_remote_code to run it")
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = Path(model_dir) / name
            text = read_text_file(path, "tokenizer file") if path.is_file() else "{}"  # names its own errors
            try:
                held = json.loads(text)
            except ValueError as bad:
                raise ValueError(f"tokenizer file {str(path)!r} cannot be read: {bad}") from None
            if not isinstance(held, dict):
                raise ValueError(f"tokenizer file {str(path)!r} must hold a JSON object, got "
                                 f"{type(held).__name__}") from None
        # the files a tokenizer's vocabulary comes in (tokenizer.json, sentencepiece's .model files, vocab.json /
        # vocab.txt, merges.txt, .tiktoken): none of them beside tokenizer_config.json is a missing file
        vocab = [f.name for f in Path(model_dir).iterdir() if f.is_file() and (
            f.suffix in (".model", ".tiktoken") or f.name in ("tokenizer.json", "merges.txt")
            or f.name.startswith("vocab"))]
        if remote is None and not vocab:
            raise ValueError(f"the tokenizer of {model_dir!r} cannot be loaded: the directory holds "
                             f"tokenizer_config.json but no vocabulary file (tokenizer.json, a .model or .tiktoken "
                             f"file, vocab.json or vocab.txt, merges.txt): is a file missing?") from None
        where = f" (its code: {remote}, from tokenizer_config.json's auto_map)" if remote is not None else ""
        raise ValueError(f"the tokenizer of {model_dir!r}{where} cannot be loaded: {type(exc).__name__}: "
                         f"{exc}") from None


def remote_tokenizer(model_dir: str) -> str | None:
    """The file of the checkpoint's own tokenizer class where it needs one (``tokenization_kimi.py``): its
    ``tokenizer_config.json`` maps ``AutoTokenizer`` (``"module.Class"``, or a ``[slow, fast]`` pair of them) to
    code in the checkpoint and names a ``tokenizer_class`` transformers does not have; else ``None`` (a file that
    does not parse is left to the loader to name).

    Raises:
        ValueError: the ``auto_map`` entry is not such a name, names code of another repository (which would be
            fetched from the Hub), or a module the checkpoint does not hold (the file and the value named); a
            ``tokenizer_config.json`` that is not a regular UTF-8 file (``checks.read_text_file``).
    """
    import json

    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    path = Path(model_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(read_text_file(path, "tokenizer file"))
    except json.JSONDecodeError:  # the tokenizer's loader names it
        return None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict) or "AutoTokenizer" not in auto_map:
        return None
    entry = auto_map["AutoTokenizer"]
    refs = entry if isinstance(entry, list) else [entry]
    named = [r for r in refs if r is not None]
    if not named or not all(isinstance(r, str) and "." in r.split("--")[-1] for r in named):
        raise ValueError(f"{path}: auto_map AutoTokenizer must name the tokenizer class as 'module.Class' (or a "
                         f"[slow, fast] pair of them, null for one missing), got {entry!r}")
    name = config.get("tokenizer_class")
    if isinstance(name, str) and tokenizer_class_from_name(name) is not None:
        return None  # transformers' own class: the auto_map is not used
    ref = named[-1]
    if "--" in ref:
        raise ValueError(f"{path}: auto_map AutoTokenizer {ref!r} names code of another repository "
                         f"({ref.split('--')[0]}), which epmoe does not fetch: put the module in the checkpoint")
    module = ref.rsplit(".", 1)[0].replace(".", "/") + ".py"
    if not (Path(model_dir) / module).is_file():
        raise ValueError(f"{path}: auto_map AutoTokenizer {ref!r} names {module}, which the checkpoint does not "
                         f"hold")
    return module


def encode_text(tokenizer, vocab_size: int, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``: the tokenizer's, with the special tokens it adds to a text (a BOS, for tokenizers that
    add one) unless ``add_special_tokens`` is false (a chat template's text holds them already), as vLLM encodes
    prompts; without a tokenizer its UTF-8 bytes modulo ``vocab_size``.

    Raises:
        ValueError: ``text`` is not valid Unicode (a lone surrogate: bytes that were not UTF-8), its position named.
    """
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompt {text!r} is not valid UTF-8 text (position {exc.start})") from None
    if tokenizer is None:
        return [b % vocab_size for b in text.encode()]
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def decode_text(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of token ids: the tokenizer's (special tokens skipped unless ``skip_special_tokens`` is false), or
    without one the ids written in decimal, one space between them (every token adds text, so a stream shows each
    as it comes)."""
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def generation_config(model_dir: str) -> dict:
    """The checkpoint's ``generation_config.json`` (transformers' generation defaults), ``{}`` when it has none.

    Raises:
        ValueError: the file is not a JSON object (the file and the parser's reason named), or not a regular UTF-8
            file (``checks.read_text_file``: a pipe would block transformers' own read of it).
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    import json

    try:
        raw = json.loads(read_text_file(path, "generation config"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(raw).__name__}")
    return raw


def check_generation_config(model_dir: str) -> None:
    """transformers' own checks of the checkpoint's ``generation_config.json``, which its ``from_pretrained`` makes
    when the reference loads: made before any rank starts, a refusal named by the file and the field (not taken for
    the ``--max-new-tokens`` or ``--temperature`` the run was given).

    Raises:
        ValueError: the file is not a JSON object, or transformers' ``GenerationConfig`` refuses a field (the file,
            the field and its value named).
    """
    from transformers import GenerationConfig

    raw = generation_config(model_dir)
    try:
        GenerationConfig.from_dict(raw)
    except (ValueError, TypeError) as exc:
        reason = str(exc).replace("`", "'")  # transformers writes `field`
        named = next((k for k in raw if f"'{k}'" in reason), None)
        what = "it" if named is None else f"field {named!r} ({raw[named]!r})"
        raise ValueError(f"{Path(model_dir) / 'generation_config.json'}: transformers' GenerationConfig refuses "
                         f"{what}: {reason}") from None


def eos_token_ids(model_dir: str, tokenizer, generation_dir: str | None = None,
                  vocab_size: int | None = None) -> frozenset[int]:
    """The end-of-sequence token ids of the checkpoint: its config's ``eos_token_id`` (one or a list; a wrapped
    model's, under ``text_config``, and the wrapper's own), its
    ``generation_config.json``'s (Qwen3 stops on ``<|im_end|>`` and ``<|endoftext|>`` there, as vLLM reads it; that
    of ``generation_dir`` instead when given) and the tokenizer's.

    ``model_dir`` may also name a ``config.json`` file (``epmoe doctor --config``): its ids alone are read then,
    unless ``generation_dir`` is given.

    Raises:
        ValueError: an unreadable ``generation_config.json`` (``generation_config``), or an ``eos_token_id`` there
            or in ``config.json`` that is not a token id or a list of them, or (given ``vocab_size``) outside the
            vocabulary (the file and the value named, as JSON writes it).
    """
    top, config_path = read_config(model_dir)
    text = language_model_config(top)
    ids: set[int] = set()
    # a wrapped model's (text_config) and, where it also names some, the wrapper's own
    sources = [(config_path, text.get("eos_token_id"))]
    if text is not top and top.get("eos_token_id") is not None:
        sources.append((config_path, top["eos_token_id"]))
    gen = generation_dir or (model_dir if Path(model_dir).is_dir() else None)
    if gen is not None:
        sources.append((Path(gen) / "generation_config.json", generation_config(gen).get("eos_token_id")))
    for path, source in sources:
        values = source if isinstance(source, list) else [] if source is None else [source]
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(f"{str(path)!r}: eos_token_id must be a token id (an integer >= 0) or a list of them, "
                             f"got {json_text(source)}")
        outside = [v for v in values if vocab_size is not None and v >= vocab_size]
        if outside:
            raise ValueError(f"{str(path)!r}: eos_token_id {outside[0]} is outside the model's vocabulary "
                             f"[0, {vocab_size}) (got {json_text(source)})")
        ids.update(values)
    tok = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok, int) and tok >= 0:
        ids.add(tok)
    return frozenset(ids)
