"""Text on the HTTP side: prompts to token ids, chat messages to a prompt, token ids back to streamed text.

The HTTP process keeps its own tokenizer. Without a tokenizer in the checkpoint (``--load-format dummy``
of a bare ``config.json``), prompts are UTF-8 bytes modulo the vocabulary, as ``Engine.encode`` does,
and generated tokens are their ids in decimal, space-separated, as ``epmoe run`` prints them
(``engine.decode_text``): every token adds text, so a stream sends one chunk per token.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path

from epmoe.checks import read_text_file
from epmoe.engine.structured import Grammars
from epmoe.engine.tokenizer import decode_text, encode_text, load_tokenizer

# The plain template of a checkpoint without one: each message on its own, then the assistant's turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_chat_template(value: str) -> str:
    """A chat template given as vLLM's ``--chat-template`` takes it: the text of the file ``value`` names, or
    ``value`` itself when it holds Jinja (a brace) or a line break.

    Raises:
        ValueError: ``value`` is neither a readable file nor a template, or the template does not parse (the
            parser's message and line named).
    """
    if Path(value).is_file():
        template = read_text_file(value, "chat_template file")
    elif any(ch in value for ch in "{}\n"):
        template = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    problem = template_problem(template)
    if problem is not None:
        raise ValueError(f"chat_template does not parse: {problem}")
    return template


def template_problem(template: str) -> str | None:
    """Why a chat template does not compile in transformers' environment (loop controls, ``{% generation %}``, as
    the tokenizer renders it): the parser's message and line, or ``None`` when it compiles (a conversation it then
    refuses is a request's 400)."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template([[{"role": "user", "content": "x"}]], chat_template=template, add_generation_prompt=True)
    except jinja2.TemplateSyntaxError as exc:  # an unknown filter or test too (TemplateAssertionError)
        return f"{exc.message} (line {exc.lineno})"
    except jinja2.TemplateError:
        pass
    return None


class TextCodec:
    """A checkpoint's tokenizer as the server uses it.

    Args:
        model_dir: the checkpoint directory.
        vocab_size: the model's vocabulary size (prompts without a tokenizer are bytes modulo it).
        chat_template: a template to use instead of the tokenizer's (``load_chat_template``'s result), or ``None``.
        trust_remote_code: run a tokenizer shipped as code with the checkpoint (``load_tokenizer``).
    """

    def __init__(self, model_dir: str, vocab_size: int, chat_template: str | None = None,
                 trust_remote_code: bool = False) -> None:
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code)
        self.vocab_size = vocab_size
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.chat_template: str | dict[str, str] = template or DEFAULT_CHAT_TEMPLATE  # a dict: named templates
        self._constraints: Grammars | None = None
        self._constraints_lock = threading.Lock()  # requests compile in worker threads: one compiler, built once

    def constraints(self) -> Grammars:
        """The structured-output compiler for this tokenizer (built on first use; ``engine.structured``).

        Raises:
            ValueError: the checkpoint has no tokenizer, or llguidance cannot read it.
        """
        with self._constraints_lock:
            if self._constraints is None:
                self._constraints = Grammars(self.tokenizer, self.vocab_size, ())
        return self._constraints

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, with the tokenizer's special tokens (a BOS) unless ``add_special_tokens`` is
        false (``engine.tokenizer.encode_text``)."""
        return encode_text(self.tokenizer, self.vocab_size, prompt, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids, special tokens skipped unless ``skip_special_tokens`` is false (an unfinished UTF-8
        sequence ends in U+FFFD); without a tokenizer the ids in decimal, space-separated."""
        return decode_text(self.tokenizer, ids, skip_special_tokens)

    def text_offsets(self, ids: Sequence[int], start: int, end: int, skip_special_tokens: bool = True) -> list[int]:
        """Where the text of each of tokens ``start .. end - 1`` begins in ``decode(ids)``: the length of the text
        of the tokens before it (past the separator without a tokenizer), never decreasing (a character split over
        tokens is counted where it completes).

        Raises:
            ValueError: not ``0 <= start <= end <= len(ids)``.
        """
        if not 0 <= start <= end <= len(ids):
            raise ValueError(f"text_offsets: tokens {start}..{end} of {len(ids)}")
        if self.tokenizer is None:
            before = sum(len(str(i)) + 1 for i in ids[:start])
            out = []
            for i in ids[start:end]:
                out.append(before)
                before += len(str(i)) + 1
            return out
        out, last = [], 0
        for i in range(start, end):
            last = max(last, len(self.decode(ids[:i], skip_special_tokens)))
            out.append(last)
        return out

    @property
    def separator(self) -> str:
        """What ``decode`` puts between two tokens' texts: nothing with a tokenizer, a space without one."""
        return "" if self.tokenizer is not None else " "

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """The text of one token as log-probabilities name it: the tokenizer's decoding of it alone, special tokens
        kept (a token ending inside a UTF-8 character reads U+FFFD); without a tokenizer its id in decimal; with
        ``as_id`` ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``: distinct for every token)."""
        if as_id:
            return f"token_id:{token_id}"
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The prompt of a conversation: the tokenizer's chat template, or ``DEFAULT_CHAT_TEMPLATE``.

        Args:
            messages: ``{"role", "content", ...}`` dicts (an assistant's ``tool_calls``, a tool's
                ``tool_call_id``).
            tools: the tools' definitions (``{"type": "function", "function": {...}}``), shown to templates that
                render them; ``None`` = none.
            kwargs: more variables for the template (``chat_template_kwargs``).
            add_generation_prompt: end with the header of the assistant's reply.
            continue_final_message: end inside the last message (``apply_chat_template``'s: its end-of-turn text
                cut off), so that the reply continues it.
        """
        kwargs = kwargs or {}
        flags = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        template = self.chat_template
        if isinstance(template, dict):  # named templates (tokenizer_config.json's list): transformers' choice
            name = "tool_use" if tools and "tool_use" in template else "default"
            if name not in template:
                raise ValueError(f"the tokenizer's chat templates {sorted(template)} hold no 'default'")
            template = template[name]
        if self.tokenizer is not None:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                                      **flags, **kwargs)
        from transformers.utils.chat_template_utils import render_jinja_template

        return render_jinja_template([messages], tools=tools, chat_template=template, **flags, **kwargs)[0][0]

    def any_special(self, texts: Sequence[str]) -> bool:
        """Whether one of ``texts`` is a special token of the tokenizer (one that decoding with
        ``skip_special_tokens`` drops)."""
        return any(t in self._special for t in texts)

    @functools.cached_property
    def _special(self) -> frozenset[str]:
        """The tokenizer's special tokens (none without a tokenizer), gathered once."""
        if self.tokenizer is None:
            return frozenset()
        return frozenset(self.tokenizer.all_special_tokens) | frozenset(
            t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)


class StreamText:
    """The text deltas of one streamed choice.

    Each call decodes all tokens so far and returns what was not sent yet, holding back an unfinished
    UTF-8 character and, with stop strings, the last ``len(longest stop) - 1`` characters (a stop string
    may be completing; the engine cuts it from the final text).

    Args:
        codec: the tokenizer.
        stop: the request's stop strings.
        skip_special_tokens: as the request decodes (``SamplingParams.skip_special_tokens``).
    """

    def __init__(self, codec: TextCodec, stop: Sequence[str], skip_special_tokens: bool = True) -> None:
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, token_ids: Sequence[int], final_text: str | None = None) -> str:
        """Text not sent yet.

        Args:
            token_ids: every token generated so far.
            final_text: on the last output, the whole text (cut before a stop string): all the rest is sent.
        """
        if final_text is not None:
            text = final_text
        else:
            text = self.codec.decode(token_ids, self.skip_special_tokens)
            if text.endswith("\ufffd"):
                text = text[:-1]
            text = text[: max(self.sent, len(text) - self.holdback)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out
