"""The pairs' alignment to slot blocks (``experts.triton.align_kernels.align_triton``) both ways, as CUDA-graph
replays on one GPU: one program in one launch (``align_program``) against the five launches of many programs (a
sentinel fill, a zero fill of the counts, the count, offsets and scatter kernels), for pair counts from a decode step
to a prefill and the slot counts of the served models (an EP-8 shard of Kimi-K2.5, Qwen3-30B-A3B's 128 experts, all
of Kimi-K2.5's 384). This is where ``align_kernels.ONE_PROGRAM_PAIRS`` comes from.

    python3 benchmarks/align.py [--pairs 8,64,...] [--slots 48,128,384] [--block-m 16] [--out FILE]

Prints one line a (pairs, slots): us a call both ways (median of graph replays of 8 calls, ``timing.graph_us``), and
writes them to ``--out`` (JSON; default ``$OUT/align.json`` where ``OUT`` is set). Needs a CUDA device and Triton.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import graph_us  # noqa: E402

MAX_SLOTS = 2048
"""Most slots a case may have: ``align_kernels.ONE_PROGRAM_SLOTS``, above which there is no one-program launch."""
MAX_PAIRS = 1 << 20
"""Most pairs a case may have (the kernels' positions are int32; a million pairs is far past any step's)."""
MAX_BLOCK_M = 256
"""Most rows a block may have (the expert kernels' largest is 128)."""


def time_both(pairs: int, slots: int, block_m: int, gen: torch.Generator) -> dict:
    """us a call of ``align_triton`` over ``pairs`` uniformly routed pairs (about a tenth skipped, as another rank's)
    with the one-program launch and with the five launches."""
    from epmoe.experts.triton import align_kernels

    ids = torch.randint(-(slots // 10) - 1, slots, (pairs,), device="cuda", generator=gen).clamp(min=-1)
    slots_t = ids.view(-1, 1)
    row = {"pairs": pairs, "slots": slots, "block_m": block_m}
    limit = align_kernels.ONE_PROGRAM_PAIRS
    try:
        for key, cap in (("one_program_us", max(limit, pairs)), ("five_launches_us", -1)):
            align_kernels.ONE_PROGRAM_PAIRS = cap
            row[key] = graph_us(lambda: align_kernels.align_triton(slots_t, slots, block_m, tail_rows=8))
    finally:
        align_kernels.ONE_PROGRAM_PAIRS = limit
    return row


def _counts(name: str, low: int, high: int | None = None):
    """An argparse type: a comma-separated list of integers in ``[low, high]``, the option named in the error."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes comma-separated integers, got {text!r}") from None
        bad = [v for v in values if v < low or (high is not None and v > high)]
        if bad:
            span = f"from {low}" + (f" to {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{name} takes integers {span}, got {bad[0]}")
        return values
    return parse


def _block_m(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 8 <= v <= MAX_BLOCK_M or v % 8:
        raise argparse.ArgumentTypeError(f"--block-m takes a multiple of 8 from 8 to {MAX_BLOCK_M} (last blocks round "
                                         f"up to 8 rows), got {text!r}")
    return v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=_counts("--pairs", 0, MAX_PAIRS), default="8,64,512,1024,2048,4096,8192,32768")
    ap.add_argument("--slots", type=_counts("--slots", 1, MAX_SLOTS), default="48,128,384")
    ap.add_argument("--block-m", type=_block_m, default=16)
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "align.json") if "OUT" in os.environ else None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/align.py times CUDA kernels: no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'pairs':>6} {'slots':>5} {'one us':>8} {'five us':>8}")
    for s in a.slots:
        for n in a.pairs:
            r = time_both(n, s, a.block_m, gen)
            rows.append(r)
            print(f"{n:6d} {s:5d} {r['one_program_us']:8.2f} {r['five_launches_us']:8.2f}", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                       "command": " ".join(["python3", "benchmarks/align.py", *sys.argv[1:]]), "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
