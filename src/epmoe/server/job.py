"""``Job``: the engine requests one OpenAI completion or chat request becomes (one per choice)."""

from __future__ import annotations

from dataclasses import dataclass

from epmoe.engine import SamplingParams
from epmoe.server.chat_output import ChatOutput


@dataclass(frozen=True)
class Job:
    """The engine requests of one HTTP request.

    Attributes:
        kind: ``completion`` or ``chat``.
        model: the model name answered.
        request_id: the response id (``cmpl-...`` / ``chatcmpl-...``).
        prompts: token ids of each prompt.
        params: per choice, its sampling options.
        n: choices per prompt.
        include_usage: streams end with a usage chunk.
        echo: completions with ``echo``: each prompt's text (as sent, or its token ids decoded with their special
            tokens), put before its choices' text; else ``None``.
        as_ids: log-probabilities name tokens ``token_id:<id>`` (``return_tokens_as_token_ids``).
        prompt_only: ``echo`` with ``max_tokens`` 0: each choice is its prompt alone (its text and log-probabilities;
            no completion tokens counted), finished with ``length``.
        sent_prompt_logprobs: vLLM's ``prompt_logprobs`` as the request sent it (the response carries them).
        constraint_field: the field the request's constraint came in (``response_format``, ``structured_outputs``,
            ``guided_*``, a forced ``tool_choice``; every choice's ``SamplingParams.structured_outputs``), or
            ``None``.
        chat: how a chat's outputs are read (reasoning, tool calls: ``chat_output.ChatOutput``), or ``None``
            (plain text).
    """

    kind: str
    model: str
    request_id: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    include_usage: bool
    echo: list[str] | None = None
    as_ids: bool = False
    prompt_only: bool = False
    sent_prompt_logprobs: int | None = None
    constraint_field: str | None = None
    chat: ChatOutput | None = None

    def choice_ids(self) -> list[str]:
        """The engine request id of each choice."""
        return [f"{self.request_id}-{i}" for i in range(len(self.params))]

    def prompt_of(self, choice: int) -> list[int]:
        """The prompt of a choice."""
        return self.prompts[choice // self.n]
