"""How much memory a device has free for one more allocation (``free_bytes``): a CUDA device's free memory, or the
host's as the kernel reports it (``MemAvailable``), or less where a memory cgroup (a container, a batch job) of this
process limits it. The engine checks an asked-for KV pool against it, and ``epmoe run`` prices its reference check
against it."""

from __future__ import annotations

import torch


def _read_number(path: str, key: str | None = None, unit: int = 1) -> int | None:
    """The non-negative integer in file ``path`` (a cgroup file), or the first on its line starting ``key``
    (``/proc/meminfo``, ``memory.stat``), times ``unit``; ``None`` where the file is unreadable, holds no such
    number or says ``max``."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if key is not None:
        lines = [line.split()[1] if len(line.split()) > 1 else "" for line in lines if line.startswith(key)]
    value = lines[0].strip() if lines else ""
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value) * unit


_MEMINFO = "/proc/meminfo"
_SELF_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"
_CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
"""Per cgroup version: the files of a cgroup's memory limit and usage, and the ``memory.stat`` field of its
reclaimable page cache."""


def _cgroup_dirs() -> list[tuple[str, str]]:
    """``(version, directory)`` of this process's memory cgroup and each ancestor up to the mount's root (a limit may
    sit on any of them), from ``/proc/self/cgroup``; empty where that cannot be read."""
    try:
        with open(_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            version, root = "v2", _CGROUP_ROOT
        elif "memory" in parts[1].split(","):
            version, root = "v1", f"{_CGROUP_ROOT}/memory"
        else:
            continue
        path = parts[2].strip("/")
        levels = path.split("/") if path else []
        for depth in range(len(levels), -1, -1):
            out.append((version, "/".join([root, *levels[:depth]])))
    return out


def _host_free_bytes() -> int | None:
    """The host memory this process may still take, bytes: the kernel's ``MemAvailable``, or less where a memory
    cgroup (a container, a batch job) of this process or an ancestor limits it: its limit less its usage, the
    reclaimable page cache (``memory.stat``'s inactive files) counted free as ``MemAvailable`` counts it (cgroup v2
    or v1); ``None`` where neither can be read (another OS)."""
    free = [_read_number(_MEMINFO, "MemAvailable:", 1024)]
    for version, directory in _cgroup_dirs():
        limit_file, usage_file, cache_field = _CGROUP_FILES[version]
        cap, used = _read_number(f"{directory}/{limit_file}"), _read_number(f"{directory}/{usage_file}")
        if cap is not None and used is not None:
            cache = _read_number(f"{directory}/memory.stat", cache_field + " ") or 0
            free.append(max(0, cap - max(0, used - cache)))
    known = [f for f in free if f is not None]
    return min(known) if known else None


def free_bytes(device: torch.device | str) -> int | None:
    """Memory free for one more allocation on ``device``, bytes: on a CUDA device its free memory
    (``torch.cuda.mem_get_info``, after the caching allocator's unused blocks are returned), on the CPU
    ``_host_free_bytes``; ``None`` where that cannot be read."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return _host_free_bytes()
