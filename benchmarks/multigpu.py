"""Multi-GPU measurements in one process group: calibrate, the MoE layer (EP vs TP), ``epmoe run``, ``epmoe plan``.

Run on a machine with G GPUs (one process per GPU, NCCL)::

    torchrun --standalone --nproc-per-node G benchmarks/multigpu.py --out DIR

and on CPU with gloo to check the script itself (tiny sizes)::

    torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py --device cpu --small --out DIR

Parts (each in its own try block; a failure is reported with its rank and traceback and the next part runs):

1. ``calibrate``: all-reduce and all-to-all time over the group from 8 B to 256 MiB with
   ``epmoe.runtime.calibrate.measure_collectives`` (median, max over ranks), device copy/matmul rates, and the
   profile ``plan`` reads (``DIR/profile.json``, needs G >= 2). On CUDA also the small-message latency
   of a raw NCCL all-to-all and all-reduce timed with CUDA events, eager and as CUDA-graph replays (the
   peer of the graph-captured dispatch below).
2. ``layer``: one MoE layer at DeepSeek-V3 (256 experts) or Kimi-K2.5 (384 experts) size: hidden 7168,
   expert intermediate 2048, top-8, one shared expert, the model's real router (random bf16 weights;
   the same seed on every rank). Per tokens-per-rank ``T``: EP with the ``all_to_all`` dispatcher
   (eager: it syncs the host for the split sizes), EP with the ``fixed_capacity`` dispatcher (capacity
   ``T``; route + dispatch + experts + combine, ``GRAPH_REPS`` calls captured in one CUDA graph and
   replayed, time per call), and the TP
   layer (``TPMoELayer``, each rank a 1/G slice of every expert, on the ``T * G`` tokens of the whole
   batch, graph replay and eager); dispatch + combine alone for both dispatchers (bytes sent / time =
   bus bandwidth, against NCCL's all-to-all from part 1) and the TP all-reduce alone. Correctness: each
   variant against the single-rank ``MoELayer`` holding all experts (reference backend) on a few tokens,
   relative error, max over ranks, with the collectives one forward issues. Timings: CUDA events, median
   after warm-up, max over ranks (perf_counter on CPU).
3. ``run``: ``epmoe run --device cuda --ep G`` in a child process (rank 0 starts it after the layer
   buffers are freed; the other ranks wait) on a Qwen3-30B-A3B checkpoint at full width with random
   weights and ``--run-layers`` decoder layers (default 4), written with transformers' ``save_pretrained``
   into a temp dir. The run job checks its tokens and logits against the unsharded transformers model.
4. ``plan``: ``epmoe.plan.planner.plan`` on the profile of part 1 (the shipped ``h200-sxm`` when G = 1), at
   the batch ``T * G`` of each measured size; its per-MoE-layer dispatch+combine, all-reduce and expert
   times beside the measurements (ratio measured / predicted).

The parts live in ``multigpu_parts/`` (``common``, ``calibrate``, ``layer``, ``run``, ``plan``, ``summary``);
this script parses the arguments, joins the group and runs them in order.

Writes ``DIR/multigpu.json`` (rewritten after each part), ``DIR/profile.json``, ``DIR/run.json`` and
``DIR/run.log``; prints a short table last. Exit code 0 when every part ran and every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

# Keep NVLink multicast off on the lent machines (KINDS.md); respected if already set.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402 - after the NCCL environment above
import torch.distributed as dist  # noqa: E402

from epmoe.runtime.calibrate import CalibrationConfig, build_profile  # noqa: E402
from multigpu_parts.calibrate import part_calibrate  # noqa: E402
from multigpu_parts.common import LAYER_MODELS, PARTS, Ctx, gather, run_part, write_doc  # noqa: E402
from multigpu_parts.layer import part_layer  # noqa: E402
from multigpu_parts.plan import part_plan  # noqa: E402
from multigpu_parts.run import part_run  # noqa: E402
from multigpu_parts.summary import summary  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "multigpu-out",
                   help="output directory (default $OUT, else ./multigpu-out)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo)")
    p.add_argument("--small", action="store_true", help="tiny sizes everywhere (checking the script)")
    p.add_argument("--experts", type=int, choices=sorted(LAYER_MODELS), default=256,
                   help="256 = DeepSeek-V3 layer, 384 = Kimi-K2.5 layer (default 256)")
    p.add_argument("--tokens", type=_ints, help="tokens per rank of the layer sweep (default 1,2,4,...,256)")
    p.add_argument("--dispatch-tokens", type=_ints, help="tokens per rank of the dispatch-alone sweep")
    p.add_argument("--check-tokens", type=int, default=4, help="tokens per rank of the correctness check")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (graphs: twice as many)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--calib-iters", type=int, default=10, help="timed calls per calibration size")
    p.add_argument("--max-bytes", type=int, help="largest calibration buffer (default 256 MiB GPU, 4 MiB CPU)")
    p.add_argument("--run-layers", type=int, default=4, help="decoder layers of the Qwen3-30B-A3B run model")
    p.add_argument("--run-new-tokens", type=int, default=8, help="--max-new-tokens of epmoe run")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds for the epmoe run child job")
    p.add_argument("--timeout", type=int, default=900, help="seconds before a stuck collective fails")
    p.add_argument("--skip", type=lambda s: [v for v in s.split(",") if v], default=[],
                   help=f"parts to skip, comma-separated: {','.join(PARTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replan", metavar="JSON", help="only part 4, on a saved multigpu.json (no GPU, no torchrun)")
    args = p.parse_args(argv)
    unknown = [s for s in args.skip if s not in PARTS]
    if unknown:
        p.error(f"--skip: unknown parts {unknown}; parts: {PARTS}")
    for flag in ("tokens", "dispatch_tokens"):
        if getattr(args, flag) is not None and (not getattr(args, flag) or min(getattr(args, flag)) < 1):
            p.error(f"--{flag.replace('_', '-')} must be comma-separated integers >= 1, got "
                    f"{','.join(map(str, getattr(args, flag)))!r}")
    for flag, low in (("check_tokens", 1), ("iters", 1), ("warmup", 0), ("calib_iters", 1), ("run_layers", 1),
                      ("run_new_tokens", 1), ("run_timeout", 1), ("timeout", 1), ("max_bytes", 8)):
        if getattr(args, flag) is not None and getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    if args.tokens is None:
        args.tokens = [1, 2, 8] if args.small else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if args.dispatch_tokens is None:
        args.dispatch_tokens = [1, 64, 512] if args.small else [1, 16, 256, 1024, 4096]
    return args


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def replan(args: argparse.Namespace) -> int:
    """Part 4 again on a saved ``multigpu.json`` (no GPU, no torchrun): the planner's current model priced on
    that run's calibration, beside that run's measurements. Writes ``--out``/``multigpu.json`` and
    ``profile.json``; prints the summary."""
    src = Path(args.replan)
    try:
        doc = json.loads(src.read_text())
        calib, world, gpu = doc["calibrate"], int(doc["world_size"]), doc["gpus"][0]
        rows, facts = calib["rows"], calib["device_facts"]
        if not rows or world < 1:
            raise ValueError("no calibration rows" if not rows else f"world_size {world}")
        for r in rows:
            float(r["bytes"]), float(r["all_reduce_ms"]), float(r["all_to_all_ms"])
        float(facts["memory_bytes"]), float(facts["hbm_bytes_per_s"]), float(facts["bf16_flops_per_s"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        print(f"--replan {src}: not a multigpu.json with calibration rows ({type(err).__name__}: {err})",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"--out {out}: exists and is not a directory", file=sys.stderr)
        return 2
    if (out / "multigpu.json").resolve() == src.resolve():
        print(f"--out {out}: would overwrite the --replan source {src}; give another directory", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"--out {out}: cannot be created ({err.strerror or err})", file=sys.stderr)
        return 2
    run_args = parse_args(doc.get("argv") or [])
    run_args.tokens = doc.get("tokens") or run_args.tokens
    ctx = Ctx(args=run_args, rank=0, world=world, local_rank=0, device=torch.device(doc.get("device", "cpu")),
              side=None, out=out, doc=doc)
    calib["profile_path"] = None  # the saved run's own path is on its machine; part 4 reads the one written here
    if world >= 2:
        path = out / "profile.json"
        cfg = CalibrationConfig(out=str(path), name=f"calibrated-{world}x-{'gpu' if ctx.cuda else 'cpu'}",
                                base="h200-sxm" if ctx.cuda else None, iters=run_args.calib_iters)
        profile = build_profile(rows, facts, world, 1, "nccl" if ctx.cuda else "gloo", gpu, cfg)
        path.write_text(json.dumps(profile, indent=2))
        calib["profile_path"] = str(path)
    doc["plan"] = part_plan(ctx)
    doc["replanned_from"] = str(src)
    text, ok = summary(ctx)
    doc["summary"] = text
    write_doc(ctx)
    print(text + f"\nreplanned from {src}; JSON in {out / 'multigpu.json'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replan is not None:
        return replan(args)
    if not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        print("multigpu.py runs under torchrun: torchrun --standalone --nproc-per-node G benchmarks/multigpu.py ...",
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available (use --device cpu)", file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout), device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout + args.run_timeout))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args=args, rank=rank, world=world, local_rank=local_rank, device=device, side=side, out=out)
    ctx.doc = {
        "script": "benchmarks/multigpu.py", "argv": sys.argv[1:], "world_size": world, "device": device.type,
        "gpus": gather(ctx, torch.cuda.get_device_name(device) if ctx.cuda else "cpu"),
        "torch": torch.__version__, "nccl": _nccl_version() if ctx.cuda else None,
        "small": args.small, "tokens": args.tokens, "dispatch_tokens": args.dispatch_tokens, "parts": {},
    }
    ctx.log(f"{world} rank(s) on {device.type} ({ctx.doc['gpus'][0]}), out {out}")
    run_part(ctx, "calibrate", part_calibrate)
    run_part(ctx, "layer", part_layer)
    run_part(ctx, "run", part_run)
    run_part(ctx, "plan", part_plan)
    ok = True
    if rank == 0:
        text, ok = summary(ctx)
        ctx.doc["summary"] = text
        ctx.doc["ok"] = ok
        write_doc(ctx)
        print("\n" + text + f"\nresult: {'OK' if ok else 'NOT OK'}; JSON in {out / 'multigpu.json'}", flush=True)
    ok = bool(gather(ctx, ok)[0])
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
