"""Where the time of the 1-token decode path goes (``triton_decode``), piece by piece, on one GPU.

Run on the device machine (needs CUDA and Triton):

    python3 benchmarks/decode_breakdown.py [--out PATH] [--cases qwen3,dsv3]

For each case of ``moe_layer.py`` at T=1 (same weights and routing: same generator sequence) every row
is timed as a CUDA-graph replay with ``moe_layer.time_fn`` (read-only L2 sweep before each replay,
median of 100):

    path             ``decode_experts`` as served (default config, PDL on)
    path_pdl_off     the same with ``pdl=False`` (two plain launches)
    gate_up          the gate/up + activation kernel alone (same grid, same compiled kernel)
    down             the down kernel alone on a precomputed ``h``, no counter reset (so after the first
                     replay no program wins the ticket and the K-sum tail is skipped)
    down_reset       the same after a ``count.zero_()`` memset node, so the K-sum tail runs
    memset           that memset node alone
    empty1           one empty Triton kernel, one program (launch floor)
    empty2           two empty kernels with the path's two grids, plain launches
    empty2_pdl       the same, the second a programmatic dependent launch (as the path)
    read_w13         a pure read of the live pairs' w13 (sum of the gate and up tiles), gate/up tiles, one
                     program row per pair (grid ``(tiles, N)``: the path before pair groups), same
                     register double buffering, no x / activation
    read_w2          the same for w2 with the down tiles
    read_both        read_w13 then read_w2, plain launches
    read_both_pdl    the same, read_w2 a programmatic dependent launch that waits after its first tile
                     (the path's launch structure without its math)
    read_one         both reads in one launch (every w13 and w2 tile of every pair, no dependency between
                     them): the weight stream of a single launch, the most a one-launch design could reach

Bytes are the live pairs' weight bytes a row reads (x, h, y, out are ignored); TB/s = bytes / time.
Prints a table and writes JSON to ``--out`` (default ``$OUT/decode_breakdown.json`` when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from types import SimpleNamespace

import torch

try:
    import triton
except ImportError:  # a GPU benchmark; Triton comes with PyTorch's CUDA build
    raise SystemExit(f"{__file__} times GPU kernels and needs Triton (installed with PyTorch's CUDA build)") from None
import triton.language as tl

from epmoe.experts import Activation, ExpertWeights
from epmoe.experts.triton.decode import (
    _ZERO_BLOCK,
    DecodeConfig,
    _decode_down_kernel,
    _decode_gate_up_kernel,
    decode_experts,
    default_decode_config,
    pair_grid,
)
from epmoe.experts.triton.grouped import act_code


@triton.jit
def _empty_kernel(p, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _read_w13_tile(slot, pid_n, w_ptr, out_ptr, pair, D, F, stride_we, stride_wn,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sum of gate/up tile ``pid_n`` of ``slot``'s ``w13`` into ``out[pair]`` (a pure read)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    wg_ptrs = w_ptr + slot * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    wu_ptrs = wg_ptrs + F * stride_wn
    first = n_ok[:, None] & (offs_k < D)[None, :]
    wg = tl.load(wg_ptrs, mask=first, other=0.0)
    wu = tl.load(wu_ptrs, mask=first, other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        nxt = n_ok[:, None] & (offs_k < D - k0 - BLOCK_K)[None, :]
        wg_next = tl.load(wg_ptrs + BLOCK_K, mask=nxt, other=0.0)
        wu_next = tl.load(wu_ptrs + BLOCK_K, mask=nxt, other=0.0)
        acc += tl.sum(wg.to(tl.float32) + wu.to(tl.float32), axis=1)
        wg = wg_next
        wu = wu_next
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    tl.store(out_ptr + pair * F + offs_n, acc, mask=n_ok)


@triton.jit
def _read_w2_tile(slot, pid_n, w_ptr, out_ptr, pair, D, F, stride_we, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Sum of down tile ``pid_n`` of ``slot``'s ``w2`` into ``out[pair]`` (a pure read); with ``PDL`` it
    waits for the preceding launch after requesting its first tile."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + slot * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_k < F)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        w_next = tl.load(w_ptrs + BLOCK_K, mask=n_ok[:, None] & (offs_k < F - k0 - BLOCK_K)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32), axis=1)
        w = w_next
        w_ptrs += BLOCK_K
    tl.store(out_ptr + pair * D + offs_n, acc, mask=n_ok)


@triton.jit
def _read_w13_kernel(slots_ptr, w_ptr, out_ptr, D, F, stride_we, stride_wn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slots_ptr + pair)
    if slot >= 0:
        _read_w13_tile(slot.to(tl.int64), pid_n, w_ptr, out_ptr, pair, D, F, stride_we, stride_wn, BLOCK_N, BLOCK_K)


@triton.jit
def _read_w2_kernel(slots_ptr, w_ptr, out_ptr, D, F, stride_we, stride_wn,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    slot = tl.load(slots_ptr + pair)
    if slot >= 0:
        _read_w2_tile(slot.to(tl.int64), pid_n, w_ptr, out_ptr, pair, D, F, stride_we, stride_wn, BLOCK_N, BLOCK_K,
                      PDL)


@triton.jit
def _read_one_kernel(slots_ptr, w13_ptr, w2_ptr, out13_ptr, out2_ptr, D, F, stride_w13e, stride_w13n, stride_w2e,
                     stride_w2n, TILES13: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
                     BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr):
    """Program ``(j, pair)``: w13 tile ``j`` when ``j < TILES13``, else w2 tile ``j - TILES13``."""
    j = tl.program_id(0)
    pair = tl.program_id(1)
    slot = tl.load(slots_ptr + pair)
    if slot >= 0:
        if j < TILES13:
            _read_w13_tile(slot.to(tl.int64), j, w13_ptr, out13_ptr, pair, D, F, stride_w13e, stride_w13n,
                           BLOCK_N1, BLOCK_K1)
        else:
            _read_w2_tile(slot.to(tl.int64), j - TILES13, w2_ptr, out2_ptr, pair, D, F, stride_w2e, stride_w2n,
                          BLOCK_N2, BLOCK_K2, False)


def buffers(x, slots, tw, w13, w2, cfg: DecodeConfig) -> SimpleNamespace:
    """The decode path's launch arguments and scratch (as ``decode_experts`` makes them), plus read outputs."""
    t, k = slots.shape
    n, f, d = t * k, w2.shape[2], w2.shape[1]
    grid1 = pair_grid(triton.cdiv(f, cfg.block_n1), n, cfg.max_programs)
    grid2 = pair_grid(triton.cdiv(d, cfg.block_n2), n, cfg.max_programs)
    read1, read2 = (grid1[0], n), (grid2[0], n)
    z = dict(dtype=torch.float32, device=x.device)
    return SimpleNamespace(
        x=x, slots=slots, tw=tw, w13=w13, w2=w2, cfg=cfg, t=t, k=k, n=n, d=d, f=f, grid1=grid1, grid2=grid2,
        read1=read1, read2=read2, n_pad=triton.next_power_of_2(n),
        h=torch.zeros(n, f, **z), y=torch.zeros(n, d, **z),
        count=torch.zeros(grid2[0], dtype=torch.int32, device=x.device),
        out=torch.empty_like(x), rh=torch.zeros(n, f, **z), ry=torch.zeros(n, d, **z))


def gate_up(b, act: Activation, pdl: bool) -> None:
    """``decode_experts``' first launch (bf16/fp16 weights, no bias, weight on output)."""
    c = b.cfg
    _decode_gate_up_kernel[b.grid1](
        b.x, b.slots, b.tw, b.w13, b.tw, b.tw, b.h, b.count,
        b.n, b.w13.shape[0], b.k, b.grid2[0], b.d, b.f, b.x.stride(0), b.w13.stride(0), b.w13.stride(1), 0, 0,
        float(act.swiglu_limit or 0.0), float(act.swiglu_alpha),
        BLOCK_N=c.block_n1, BLOCK_K=c.block_k1, N_PAD=b.n_pad, GROUPS=b.grid1[1],
        ONE_PAIR=b.grid1[1] == b.n, ACT=act_code(act), FP8=False,
        HAS_BIAS=False, WEIGHT_ON_INPUT=False, ZERO_BLOCK=_ZERO_BLOCK, PDL=pdl, num_warps=c.num_warps,
    )


def down(b, pdl: bool, launch_pdl: bool) -> None:
    """``decode_experts``' second launch; ``pdl`` picks the compiled variant, ``launch_pdl`` the launch."""
    c = b.cfg
    _decode_down_kernel[b.grid2](
        b.h, b.slots, b.tw, b.w2, b.tw, b.tw, b.y, b.count, b.out,
        b.t, b.k, b.n, b.w2.shape[0], b.d, b.f, b.w2.stride(0), b.w2.stride(1), 0, 0, b.out.stride(0),
        BLOCK_N=c.block_n2, BLOCK_K=c.block_k2, K_PAD=triton.next_power_of_2(b.k), N_PAD=b.n_pad,
        GROUPS=b.grid2[1], ONE_PAIR=b.grid2[1] == b.n, FP8=False,
        HAS_BIAS=False, WEIGHT_ON_INPUT=False, PDL=pdl, num_warps=c.num_warps, launch_pdl=launch_pdl,
    )


def read_w13(b, pdl: bool) -> None:
    c = b.cfg
    _read_w13_kernel[b.read1](b.slots, b.w13, b.rh, b.d, b.f, b.w13.stride(0), b.w13.stride(1),
                              BLOCK_N=c.block_n1, BLOCK_K=c.block_k1, PDL=pdl, num_warps=c.num_warps)


def read_w2(b, pdl: bool) -> None:
    c = b.cfg
    _read_w2_kernel[b.read2](b.slots, b.w2, b.ry, b.d, b.f, b.w2.stride(0), b.w2.stride(1),
                             BLOCK_N=c.block_n2, BLOCK_K=c.block_k2, PDL=pdl, num_warps=c.num_warps, launch_pdl=pdl)


def read_one(b) -> None:
    c = b.cfg
    _read_one_kernel[(b.read1[0] + b.read2[0], b.n)](
        b.slots, b.w13, b.w2, b.rh, b.ry, b.d, b.f, b.w13.stride(0), b.w13.stride(1), b.w2.stride(0),
        b.w2.stride(1), TILES13=b.read1[0], BLOCK_N1=c.block_n1, BLOCK_K1=c.block_k1, BLOCK_N2=c.block_n2,
        BLOCK_K2=c.block_k2, num_warps=c.num_warps)


def empty(grid, pdl: bool, p: torch.Tensor, launch_pdl: bool = False) -> None:
    _empty_kernel[grid](p, PDL=pdl, launch_pdl=launch_pdl)


def run_case(x, slots, tw, w: ExpertWeights, timer, pdl: bool = True) -> dict:
    """Check the replicated launches against ``decode_experts``, then time every row (``timer(fn)`` -> us).

    ``pdl=False`` (the CPU interpreter) leaves out the programmatic dependent launches.
    """
    act = Activation()
    s, two_f, d = w.w13.shape
    f = two_f // 2
    cfg = replace(default_decode_config(d, f, w.w13.element_size()), pdl=pdl)
    b = buffers(x, slots, tw, w.w13, w.w2, cfg)
    live = int((slots >= 0).sum())
    esz = w.w13.element_size()
    b13, b2 = live * 2 * f * d * esz, live * d * f * esz

    path = lambda: decode_experts(x, slots, tw, w, act_code(act), act, config=cfg)  # noqa: E731
    ref = path()
    gate_up(b, act, pdl)
    down(b, pdl, pdl)
    check = {"replica_equals_path": bool(torch.equal(b.out, ref))}
    h_ref = b.h.clone()
    live_rows = (slots.reshape(-1) >= 0).nonzero().reshape(-1).tolist()
    read_w13(b, False)
    read_w2(b, False)
    ws = slots.reshape(-1).tolist()
    e13 = torch.stack([w.w13[ws[p]].float().reshape(2, f, d).sum(dim=(0, 2)) for p in live_rows])
    e2 = torch.stack([w.w2[ws[p]].float().sum(dim=1) for p in live_rows])
    check["read_w13_max_err"] = (b.rh[live_rows] - e13).abs().max().item()
    check["read_w2_max_err"] = (b.ry[live_rows] - e2).abs().max().item()
    b.rh.zero_()
    b.ry.zero_()
    read_one(b)
    check["read_one_max_err"] = max((b.rh[live_rows] - e13).abs().max().item(),
                                    (b.ry[live_rows] - e2).abs().max().item())

    def down_reset():
        b.count.zero_()
        down(b, pdl, False)

    def both(fa, fb):
        def fn():
            fa()
            fb()
        return fn

    rows = [
        ("path", path, b13 + b2),
        ("path_pdl_off", lambda: decode_experts(x, slots, tw, w, act_code(act), act, config=replace(cfg, pdl=False)),
         b13 + b2),
        ("gate_up", lambda: gate_up(b, act, pdl), b13),
        ("down", lambda: down(b, pdl, False), b2),
        ("down_reset", down_reset, b2),
        ("memset", b.count.zero_, 0),
        ("empty1", lambda: empty((1,), False, b.count), 0),
        ("empty2", both(lambda: empty(b.grid1, False, b.count), lambda: empty(b.grid2, False, b.count)), 0),
        ("empty2_pdl", both(lambda: empty(b.grid1, pdl, b.count), lambda: empty(b.grid2, pdl, b.count, pdl)), 0),
        ("read_w13", lambda: read_w13(b, False), b13),
        ("read_w2", lambda: read_w2(b, False), b2),
        ("read_both", both(lambda: read_w13(b, False), lambda: read_w2(b, False)), b13 + b2),
        ("read_both_pdl", both(lambda: read_w13(b, pdl), lambda: read_w2(b, pdl)), b13 + b2),
        ("read_one", lambda: read_one(b), b13 + b2),
    ]
    out = []
    for name, fn, nbytes in rows:
        try:
            us = timer(fn)
            tb_s = nbytes / (us * 1e-6) / 1e12 if nbytes else None
            out.append({"name": name, "us": us, "bytes": nbytes, "tb_s": tb_s})
        except Exception as e:  # one failing row must not cost the others (one device call)
            out.append({"name": name, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(out[-1]), flush=True)
    # the down kernel on the h the path computed is still the path's output (h untouched by the rows above)
    check["h_unchanged"] = bool(torch.equal(b.h, h_ref))
    return {"config": asdict(cfg), "live_pairs": live, "active_slots": int(torch.unique(slots[slots >= 0]).numel()),
            "grid_gate_up": list(b.grid1), "grid_down": list(b.grid2), "w13_bytes": b13, "w2_bytes": b2,
            "checks": check, "rows": out}


def print_table(result: dict) -> None:
    """The per-case table: time, weight bytes read, bytes / time."""
    print(f"\ncopy ceiling {result['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    for name, r in result["cases"].items():
        print(f"\n{name}: live pairs {r['live_pairs']}, grids {r['grid_gate_up']} / {r['grid_down']}, "
              f"floor {r['floor_us']:.1f} us, checks {r['checks']}")
        print(f"{'row':14} {'us':>7} {'MB':>7} {'TB/s':>6}")
        for row in r["rows"]:
            if "error" in row:
                print(f"{row['name']:14} {row['error']}")
            else:
                tb = f"{row['tb_s']:6.2f}" if row["tb_s"] else f"{'-':>6}"
                print(f"{row['name']:14} {row['us']:7.1f} {row['bytes'] / 1e6:7.1f} {tb}")


def main(argv: list[str] | None = None) -> None:
    from moe_layer import CASES, make_routing, measure_ceilings
    from timing import time_fn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out = os.path.join(os.environ["OUT"], "decode_breakdown.json") if "OUT" in os.environ else None
    p.add_argument("--out", default=out)
    p.add_argument("--cases", default="qwen3,dsv3")
    args = p.parse_args(argv)
    ceil = measure_ceilings()
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.float16)
    timer = lambda fn: time_fn(fn, True, flush) * 1e3  # noqa: E731
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "ceilings": ceil, "cases": {}}
    for name in args.cases.split(","):
        case = CASES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)  # bench_case's sequence: weights, then T=1 routing
        s, d, f = case["slots"], case["d"], case["f"]
        w = ExpertWeights(
            (torch.randn(s, 2 * f, d, device="cuda", generator=gen) / d**0.5).to(torch.bfloat16),
            (torch.randn(s, d, f, device="cuda", generator=gen) / f**0.5).to(torch.bfloat16),
        )
        x, slots, tw = make_routing(case, 1, gen)
        r = run_case(x, slots, tw, w, timer)
        r["floor_us"] = (r["w13_bytes"] + r["w2_bytes"]) / ceil["copy_bytes_per_s"] * 1e6
        result["cases"][name] = r
        del w
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)
    print_table(result)


if __name__ == "__main__":
    main()
