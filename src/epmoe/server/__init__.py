"""The OpenAI-compatible HTTP server on the engine's step API (``epmoe serve``) and its load generator
(``epmoe bench serve``).

Modules: ``config`` (``ServeConfig``, the options), ``protocol`` (the OpenAI request and response schema,
pydantic), ``text`` (chat template, streamed text deltas), ``ranks`` (the multi-rank step: rank 0 hands
the other ranks their new requests and aborts, gathers their outputs), ``core`` (the rank processes: rank
0's engine loop, apart from the HTTP process), ``frontend`` (the HTTP process's side of the core's pipe
and the per-request output queues), ``metrics`` (Prometheus), ``app`` (FastAPI routes), ``serve``
(processes, drain on SIGTERM, rank-death handling), ``bench`` (``bench serve``); one request's way through:
``prompts`` (the chat's rendered prompt, ``/tokenize``), ``generate`` (a request to its engine requests, a ``job``,
and their updates back to a response or a stream), ``replies`` (a choice's message, log-probabilities and usage as
the API writes them), ``chat_output`` with ``reasoning`` and ``tools`` (a chat's output read as reasoning and tool
calls), ``responses`` (OpenAI's Responses API on the chat path).
"""
