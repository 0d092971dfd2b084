"""Routing: which experts each token goes to, and which physical copy serves each choice.

``router`` holds ``Router`` (the gates of every family; on CUDA the top-k after the logits is one Triton
kernel, ``router_triton``, which takes explicit flags; ``ROUTING_SIMULATIONS``: what it may route by instead, for
benchmarks of random weights); ``slot_map`` holds ``SlotMap`` (logical ids ->
global physical slot ids, with the replica policies ``static``, ``round_robin``, ``random``).
"""

from __future__ import annotations

from epmoe.routing.router import ROUTING_SIMULATIONS, Router
from epmoe.routing.slot_map import REPLICA_POLICIES, ReplicaPolicy, SlotMap

__all__ = ["REPLICA_POLICIES", "ROUTING_SIMULATIONS", "ReplicaPolicy", "Router", "SlotMap"]
