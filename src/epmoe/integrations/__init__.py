"""epmoe for people who serve with SGLang, vLLM or TensorRT-LLM.

``dumps``: their expert-load dumps read into one ``LoadDump`` (``epmoe balance --loads``); ``placements``: the
placement files they take, checked as they would check them and written atomically (``--out-format``,
``--from``, ``epmoe doctor --placement``); ``sglang`` and ``vllm``: plug-ins (entry points of their plug-in
groups, switched on with ``EPMOE_EPLB=1``) that make the server's live rebalancing use epmoe's balancer;
``commands``: the server command lines that realise a plan (``epmoe plan --engine``). The drop-in
``rebalance_experts`` with DeepSeek's signature is ``epmoe.compat``.
"""

from __future__ import annotations

from epmoe.integrations.dumps import LOAD_FORMATS, LoadDump, detect_load_format, read_load_dump
from epmoe.integrations.placements import (
    PLACEMENT_FORMATS,
    LayeredPlacement,
    load_placement_as,
    save_placement_as,
    sglang_map,
)

__all__ = [
    "LOAD_FORMATS", "PLACEMENT_FORMATS", "LayeredPlacement", "LoadDump", "detect_load_format", "load_placement_as",
    "read_load_dump", "save_placement_as", "sglang_map",
]
