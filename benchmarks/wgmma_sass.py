"""The INT4/MXFP4 prefill kernels (``experts/triton/w4a16_wgmma.py``) compiled for sm_90a on any machine, no GPU:
what ptxas makes of them.

    pip install --target /tmp/tri "triton==3.6.0"     # Triton's wheel ships ptxas and cuobjdump
    PYTHONPATH=/tmp/tri:src python benchmarks/wgmma_sass.py [FIELD=VALUE ...] [--sass DIR]

The fields are ``WgmmaConfig``'s (default: the tiles the backend takes for Kimi-K2.5's experts at prefill sizes,
``default_wgmma_config(32, 4096 * 8, 48)``), e.g. ``stages=4`` or ``words_smem=False``. Both kernels are compiled
for Kimi-K2.5's shapes (hidden 7168, intermediate 2048, group 32, bf16, SiLU, no bias), with the pointer and
stride specialisations a launch there gets. Per kernel: ptxas's registers, spills and warnings (a
``wgmma.mma_async`` serialisation warning names lost tensor-core overlap), and, over the SASS of the main loop of its
whole-block branch (the loop with the most ``HGMMA``), the tensor-core instructions a step and the CTA barriers
(``BAR.SYNC``) between them, where every warp of the program waits. ``--sass DIR`` writes each kernel's SASS there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, fields

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from epmoe.experts.triton import w4a16_wgmma as wg
from epmoe.experts.triton.grouped import act_code
from epmoe.experts.triton.w4a16_wgmma_config import WgmmaConfig, check_wgmma_config, default_wgmma_config
from epmoe.experts.weights import Activation

D, F, GROUP = 7168, 2048, 32
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _source(fn, types: dict[str, str], consts: dict) -> GluonASTSource:
    """``fn``'s compile source: ``types`` of its runtime arguments (a ``*`` type or ``i32``/``fp32``; ``!`` after
    it marks an integer a launch sees as a multiple of 16), ``consts`` its constexprs."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        t = types[name]
        signature[name] = t.rstrip("!")
        if t.startswith("*") or t.endswith("!"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return GluonASTSource(fn, signature, consts, attrs)


def kernel_sources(cfg: WgmmaConfig) -> dict[str, tuple[GluonASTSource, dict]]:
    """The gate/up and down kernels' sources for Kimi-K2.5's shapes and ``cfg``, with their compile options."""
    i, i16, f = "i32", "i32!", "fp32"
    ptrs = dict(w_ptr="*i32", s_ptr="*bf16", b_ptr="*fp32", tw_ptr="*fp32", sorted_ptr="*i32",
                block_slot_ptr="*i32", block_start_ptr="*i32", block_rows_ptr="*i32")
    strides = dict(num_pairs=i16, D=i16, F=i16, stride_we=i16, stride_wn=i16, stride_se=i16, stride_sn=i16,
                   stride_h=i16)
    gate_up = _source(wg._gate_up_kernel, dict(xw_ptr="*bf16", h_ptr="*bf16", top_k=i, stride_x=i16, act_limit=f,
                                                act_alpha=f, **ptrs, **strides), dict(
        BLOCK_N=cfg.block_n1, BLOCK_KW=cfg.block_kw1, BLOCK_KW2=cfg.block_kw2, BLOCK_M=cfg.block_m, GW=GROUP // 8,
        STAGES=cfg.stages, NUM_WARPS=cfg.num_warps, ACT=act_code(Activation()), HAS_BIAS=False, WEIGHT_ON_INPUT=False,
        EVEN=True, TAIL=cfg.tail_rows or cfg.block_m, WORDS_SMEM=cfg.words_smem))
    down = _source(wg._down_kernel, dict(h_ptr="*bf16", y_ptr="*fp32", **ptrs, **strides), dict(
        BLOCK_N=cfg.block_n2, BLOCK_KW=cfg.block_kw2, BLOCK_M=cfg.block_m, GW=GROUP // 8, STAGES=cfg.stages,
        NUM_WARPS=cfg.num_warps, HAS_BIAS=False, WEIGHT_ON_INPUT=False, EVEN=True, TAIL=cfg.tail_rows or cfg.block_m))
    opts = {"num_warps": cfg.num_warps}
    return {"gate_up": (gate_up, opts),
            "down": (down, {**opts, **({"maxnreg": cfg.maxnreg2} if cfg.maxnreg2 else {})})}


def _instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every SASS instruction, the predicate dropped."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([^;]+);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def main_loop(sass: str) -> Counter:
    """The opcode counts of the loop (a backward branch's span) holding the most ``HGMMA``."""
    ins = _instructions(sass)
    index = {addr: k for k, (addr, _) in enumerate(ins)}
    best: Counter = Counter()
    for k, (addr, text) in enumerate(ins):
        m = re.match(r"BRA\s+(?:`\(.*\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            body = Counter(t.split()[0] for _, t in ins[index[int(m.group(1), 16)]:k + 1])
            if sum(v for op, v in body.items() if op.startswith("HGMMA")) > sum(
                    v for op, v in best.items() if op.startswith("HGMMA")):
                best = body
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("fields", nargs="*", metavar="FIELD=VALUE", help="WgmmaConfig fields")
    ap.add_argument("--sass", metavar="DIR", help="write each kernel's SASS into DIR")
    args = ap.parse_args()
    names = {f.name for f in fields(WgmmaConfig)}
    given = {}
    for item in args.fields:
        key, _, value = item.partition("=")
        if key not in names or not value:
            ap.error(f"{item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(names))}")
        given[key] = {"True": True, "False": False, "None": None}.get(value, value)
        if isinstance(given[key], str):
            try:
                given[key] = int(value)
            except ValueError:
                ap.error(f"{item!r}: the value must be an integer, True, False or None")
    cfg = WgmmaConfig(**{**asdict(default_wgmma_config(GROUP, 4096 * 8, 48)), **given})
    try:
        check_wgmma_config(cfg, GROUP)
    except ValueError as exc:
        ap.error(str(exc))
    print(cfg)
    target = GPUTarget("cuda", 90, 32)
    for name, (src, opts) in kernel_sources(cfg).items():
        ptx = triton.compile(src, target=target, options=opts).asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(ptx_path, "w") as fh:
                fh.write(ptx)
            ptxas = subprocess.run([os.path.join(_BIN, "ptxas"), "-arch=sm_90a", "-v", "--warn-on-spills", ptx_path,
                                    "-o", cubin], capture_output=True, text=True, check=True)
            sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
        report = [line.split(":", 1)[-1].strip() for line in (ptxas.stdout + ptxas.stderr).splitlines()
                  if "Used" in line or "spill" in line or "arning" in line]
        loop = main_loop(sass)
        hgmma = sum(v for op, v in loop.items() if op.startswith("HGMMA"))
        print(f"{name}: " + "; ".join(report))
        print(f"  main loop: {sum(loop.values())} instructions, {hgmma} HGMMA, {loop['BAR.SYNC.DEFER_BLOCKING']} "
              f"BAR.SYNC, {loop['WARPGROUP.DEPBAR.LE']} WARPGROUP.DEPBAR, "
              f"{sum(v for op, v in loop.items() if op.startswith('LDGSTS'))} LDGSTS, "
              f"{sum(v for op, v in loop.items() if op.startswith(('LOP3', 'HFMA2', 'HMUL2', 'SHF', 'PRMT')))} "
              f"widening ops (LOP3/HFMA2/HMUL2/SHF/PRMT)")
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, f"{name}.sass"), "w") as fh:
                fh.write(sass)


if __name__ == "__main__":
    main()
