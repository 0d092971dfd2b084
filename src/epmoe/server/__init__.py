"""The OpenAI-compatible HTTP server on the engine's step API (``epmoe serve``) and its load generator
(``epmoe bench serve``).

Modules: ``config`` (``ServeConfig``, the options), ``protocol`` (the OpenAI request and response schema,
pydantic), ``text`` (chat template, streamed text deltas), ``ranks`` (the multi-rank step: rank 0 hands
the other ranks their new requests and aborts, gathers their outputs), ``frontend`` (the engine loop's
thread and the per-request output queues), ``metrics`` (Prometheus), ``app`` (FastAPI routes), ``serve``
(start-up, drain on SIGTERM, rank-death handling), ``bench`` (``bench serve``).
"""
