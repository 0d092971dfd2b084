"""``engine.gemv``: the decode projections' kernel under the Triton interpreter (against ``F.linear``), the
operand checks, and ``linear``'s choice (the module itself wherever the kernel does not apply)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

import epmoe.engine.gemv as gemv_mod
from epmoe.engine.decoder import FOLD_NORM_MAX_WIDTH, fold_or_add_norm
from epmoe.engine.fused_norm import FusedRMSNorm
from epmoe.engine.gemv import (
    GEMV_MAX_K,
    GEMV_MAX_ROWS,
    GEMV_MAX_WEIGHT_BYTES,
    gemv,
    gemv_add_norm,
    gemv_fits,
    linear,
    norm_folds,
)
from epmoe.layer import FoldedNorm


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter has no bf16
@pytest.mark.parametrize("m,n,k", [(1, 37, 100), (2, 64, 128), (2, 9, 200), (1, 5, 16), (1, 3, 1)])
@pytest.mark.parametrize("bias", [None, "contiguous", "strided"])
def test_gemv_equals_linear(dtype, m, n, k, bias):
    """Ragged ``N`` (a last program's masked rows), ``K`` not a power of two (masked columns), ``K`` of 1, with
    no bias, a bias and a strided bias (every other element of a longer one); rows with a stride (a view of wider
    rows)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    wide = torch.randn(m, k + 8, generator=gen).to(dtype)
    x = wide[:, 3:k + 3]  # row stride k + 8, contiguous along K
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = None if bias is None else torch.randn(2 * n, generator=gen).to(dtype)
    b = b[:n] if bias == "contiguous" else b[::2] if bias == "strided" else None
    got = gemv(x, w, b, pdl=False)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_gemv_refuses_operands_by_name():
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match=r"x \(1, 64\), weight \(8, 32\) and bias None do not agree"):
        gemv(x, torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"bias \(7,\) do not agree"):
        gemv(x, torch.randn(8, 64), torch.randn(7))
    with pytest.raises(ValueError, match=r"x \(64,\), weight \(8, 64\)"):
        gemv(torch.randn(64), torch.randn(8, 64))
    with pytest.raises(ValueError, match=f"at most {GEMV_MAX_ROWS} rows.*: {GEMV_MAX_ROWS + 1} rows"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match=f"K <= {GEMV_MAX_K}.*K {GEMV_MAX_K + 1}"):
        gemv(torch.randn(1, GEMV_MAX_K + 1), torch.randn(2, GEMV_MAX_K + 1))
    with pytest.raises(ValueError, match=r"weight strides \(1, 8\)"):
        gemv(x, torch.randn(64, 8).t())
    with pytest.raises(ValueError, match=r"x strides \(1, 2\)"):
        gemv(torch.randn(64, 2).t(), torch.randn(8, 64))
    with pytest.raises(ValueError, match="x torch.float16, weight torch.float32, bias None"):
        gemv(x.half(), torch.randn(8, 64))
    with pytest.raises(ValueError, match="x torch.float32, weight torch.float32, bias torch.float64"):
        gemv(x, torch.randn(8, 64), torch.randn(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x torch.int64"):
        gemv(x.long(), torch.randn(8, 64).long())
    with pytest.raises(ValueError, match="x on cpu, weight on meta and bias on None: one device"):
        gemv(x, torch.randn(8, 64, device="meta"))


def test_gemv_says_where_it_runs(monkeypatch):
    """CPU rows run only under the interpreter, and there without the dependent launch (``griddepcontrol`` is
    Hopper's)."""
    x, w = torch.randn(1, 64), torch.randn(8, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="x on cpu, pdl False, TRITON_INTERPRET None"):
        gemv(x, w)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="x on cpu, pdl True, TRITON_INTERPRET '1'"):
        gemv(x, w, pdl=True)


def test_gemv_no_rows_outputs_or_inputs():
    assert gemv(torch.randn(0, 64), torch.randn(8, 64)).shape == (0, 8)
    assert gemv(torch.randn(2, 64), torch.randn(0, 64)).shape == (2, 0)
    b = torch.randn(8)
    assert torch.equal(gemv(torch.randn(2, 0), torch.randn(8, 0), b), b.expand(2, 8))  # K = 0: the bias alone
    assert torch.equal(gemv(torch.randn(1, 0), torch.randn(3, 0)), torch.zeros(1, 3))


@pytest.fixture
def with_pdl(monkeypatch):
    """The CPU as if it launched dependents (``pdl_launch`` true): ``gemv_fits``' other conditions decide."""
    monkeypatch.setattr(gemv_mod, "pdl_launch", lambda t: True)


def test_gemv_fits_each_condition(with_pdl, monkeypatch):
    rows = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(24, 64, dtype=torch.bfloat16)
    assert gemv_fits(rows, w, None) and gemv_fits(rows, w, torch.randn(24, dtype=torch.bfloat16))
    assert gemv_fits(torch.randn(GEMV_MAX_ROWS, 64, dtype=torch.float16), w.half(), None)
    big = torch.empty(GEMV_MAX_WEIGHT_BYTES // 2048 + 1, 1024, dtype=torch.bfloat16)
    assert gemv_fits(torch.randn(1, 1024, dtype=torch.bfloat16), big, None)  # one row: any weight size
    refused = {
        "more rows": (torch.randn(GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16), w, None),
        "float32": (rows.float(), w.float(), None),
        "weight dtype": (rows, w.half(), None),
        "bias dtype": (rows, w, torch.randn(24)),
        "weight not contiguous": (rows, torch.randn(64, 24, dtype=torch.bfloat16).t(), None),
        "rows strided along K": (torch.randn(64, 2, dtype=torch.bfloat16).t()[:1], w, None),
        "K = 0": (rows[:, :0], w[:, :0], None),
        "K too wide": (torch.randn(1, GEMV_MAX_K + 1, dtype=torch.bfloat16),
                       torch.randn(1, GEMV_MAX_K + 1, dtype=torch.bfloat16), None),
        "weight too large at two rows": (torch.randn(2, 1024, dtype=torch.bfloat16), big, None),
    }
    for why, (r, ww, b) in refused.items():
        assert not gemv_fits(r, ww, b), why
    monkeypatch.setenv("EPMOE_GEMV", "0")
    assert not gemv_fits(rows, w, None)


@pytest.mark.interpret
def test_linear_runs_the_kernel_for_a_plain_linear(with_pdl, monkeypatch):
    """With ``gemv_fits`` true (the CPU made to look capable), ``linear`` runs the kernel (under the interpreter,
    without the dependent launch it cannot run) on ``[1, T, K]`` rows and keeps their leading dimensions."""
    calls = []

    def no_pdl(x, weight, bias=None, *, pdl=None):
        calls.append(tuple(x.shape))
        return gemv(x, weight, bias, pdl=False)  # this module's name: the kernel's entry, not the stand-in

    monkeypatch.setattr(gemv_mod, "gemv", no_pdl)
    torch.manual_seed(0)
    lin = nn.Linear(100, 24).half()
    x = torch.randn(1, 2, 100).half()
    with torch.no_grad():
        got = linear(lin, x)
        want = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    assert calls == [(2, 100)] and got.shape == (1, 2, 24)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_linear_is_the_module_where_the_kernel_does_not_apply(with_pdl):
    """Hooks, an instance ``forward``, a subclass, a gradient to record, more rows than ``GEMV_MAX_ROWS`` and
    ``K`` of 0: ``linear`` calls the module (the kernel would fail on the CPU, so any other path raises)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 24).to(torch.bfloat16)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    out = linear(lin, x)  # grad enabled and the weight requires it: the module, recording the graph
    assert out.grad_fn is not None and torch.equal(out, lin(x))
    with torch.no_grad():
        handle = lin.register_forward_hook(lambda mod, args, result: result * 0)
        assert torch.equal(linear(lin, x), torch.zeros(1, 1, 24, dtype=torch.bfloat16))
        handle.remove()
        handle = lin.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
        assert torch.equal(linear(lin, x), lin.bias.expand(1, 1, 24))
        handle.remove()
        lin.forward = lambda t: t[..., :24] * 2
        assert torch.equal(linear(lin, x), x[..., :24] * 2)
        del lin.forward

        class Scaled(nn.Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        scaled = Scaled(64, 24).to(torch.bfloat16)
        assert torch.equal(linear(scaled, x), 2 * F.linear(x, scaled.weight, scaled.bias))
        more = torch.randn(1, GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
        assert torch.equal(linear(lin, more), lin(more))
        empty = nn.Linear(0, 4).to(torch.bfloat16)
        assert torch.equal(linear(empty, x[..., :0]), empty(x[..., :0]))


def test_linear_on_the_cpu_is_the_module():
    lin = nn.Linear(64, 24).to(torch.bfloat16)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    assert not gemv_fits(x[0], lin.weight, lin.bias)  # no dependent launches on the CPU
    with torch.no_grad():
        assert torch.equal(linear(lin, x), lin(x))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter has no bf16
@pytest.mark.parametrize("m,n,k", [(1, 37, 96), (2, 64, 128)])
@pytest.mark.parametrize("weight_then_cast", [False, True])
def test_gemv_add_norm_equals_the_norm_then_the_projection(dtype, m, n, k, weight_then_cast):
    """The folded launch gives what ``FusedRMSNorm.add_forward`` then ``gemv`` give, bit for bit (the same
    arithmetic and roundings), and the same sum; into a given ``summed`` too."""
    gen = torch.Generator().manual_seed(m * 100 + k)
    norm = FusedRMSNorm(nn.Parameter((torch.rand(k, generator=gen) + 0.5).to(dtype)), 1e-6, weight_then_cast)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    r = (torch.randn(m, k, generator=gen) * 5).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    normed, want_sum = norm.add_forward(x, r)
    want = gemv(normed, w, b, pdl=False)
    got, summed = gemv_add_norm(x, r, norm.weight, norm.eps, w, b, weight_then_cast=weight_then_cast, pdl=False)
    assert torch.equal(summed, want_sum) and torch.equal(summed, r + x)
    assert torch.equal(got, want)
    out = torch.full((m, k), 7.0, dtype=dtype)
    got2, summed2 = gemv_add_norm(x, r, norm.weight, norm.eps, w, b, weight_then_cast=weight_then_cast, pdl=False,
                                  summed=out)
    assert summed2 is out and torch.equal(out, want_sum) and torch.equal(got2, want)


def test_gemv_add_norm_refuses_operands_by_name():
    x, r, nw, w = torch.randn(1, 64), torch.randn(1, 64), torch.rand(64), torch.randn(8, 64)
    bad = {
        r"residual \(1, 32\) torch.float32 on cpu strides .* must match x \(1, 64\)": dict(residual=r[:, :32]),
        r"residual \(1, 64\) torch.float16": dict(residual=r.half()),
        r"residual must be a torch.Tensor, got NoneType": dict(residual=None),
        r"weight \(32,\) torch.float32 on cpu must be a contiguous \[64\] float tensor": dict(norm_weight=nw[:32]),
        r"weight \(64,\) torch.float16 .* of x's dtype torch.float32": dict(norm_weight=nw.half()),
        r"weight \(64,\) torch.int32 .* float tensor": dict(norm_weight=torch.ones(64, dtype=torch.int32)),
        r"summed \(2, 64\) torch.float32 on cpu": dict(summed=torch.empty(2, 64)),
        r"summed shares memory with residual": dict(summed=r),
        r"summed shares memory with x": dict(summed=x),
        r"eps must be a finite real number >= 0, got nan": dict(eps=float("nan")),
        r"eps must be a finite real number >= 0, got None": dict(eps=None),
        r"weight_then_cast must be a bool, got 'no'": dict(weight_then_cast="no"),
        r"x \(1, 64\), weight \(8, 32\) and bias None do not agree": dict(weight=torch.randn(8, 32)),
        r"gemv_add_norm: x must be a torch.Tensor, got NoneType": dict(x=None),
    }
    for message, change in bad.items():
        args = dict(x=x, residual=r, norm_weight=nw, eps=1e-6, weight=w, weight_then_cast=False) | change
        with pytest.raises((TypeError, ValueError), match=message):
            gemv_add_norm(args.pop("x"), args.pop("residual"), args.pop("norm_weight"), args.pop("eps"),
                          args.pop("weight"), **args)


def test_gemv_add_norm_without_rows_or_inputs():
    """No rows, ``K`` of 0 or no outputs: ``gemv``'s result (the bias where ``K`` is 0) and the sum, no launch."""
    b = torch.arange(4.0)
    y, summed = gemv_add_norm(torch.empty(1, 0), torch.empty(1, 0), torch.empty(0), 1e-6, torch.empty(4, 0), b)
    assert torch.equal(y, b[None]) and summed.shape == (1, 0)
    y, summed = gemv_add_norm(torch.empty(0, 8), torch.empty(0, 8), torch.rand(8), 1e-6, torch.randn(4, 8))
    assert y.shape == (0, 4) and summed.shape == (0, 8)
    x, r = torch.randn(2, 8), torch.randn(2, 8)
    y, summed = gemv_add_norm(x, r, torch.rand(8), 1e-6, torch.randn(0, 8))
    assert y.shape == (2, 0) and torch.equal(summed, x + r)


def test_norm_folds_each_condition(with_pdl, monkeypatch):
    """``norm_folds``: where ``linear`` would run the kernel and the norm's weight is one the kernel takes."""
    lin = nn.Linear(64, 24).to(torch.bfloat16).requires_grad_(False)
    nw = torch.rand(64, dtype=torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert norm_folds(lin, x, nw, False) and norm_folds(lin, x.expand(2, 64).contiguous(), nw, False)
    assert norm_folds(lin, x, nw.float(), True)
    hooked = nn.Linear(64, 24).to(torch.bfloat16).requires_grad_(False)
    hooked.register_forward_hook(lambda *a: None)
    refused = {
        "a float32 weight cast first": (lin, x, nw.float(), False),
        "a norm of another width": (lin, x, nw[:32], False),
        "a strided norm weight": (lin, x, torch.rand(128, dtype=torch.bfloat16)[::2], False),
        "more rows": (lin, torch.randn(GEMV_MAX_ROWS + 1, 64, dtype=torch.bfloat16), nw, False),
        "a hooked linear": (hooked, x, nw, False),
    }
    for why, args in refused.items():
        assert not norm_folds(*args), why
    monkeypatch.setenv("EPMOE_GEMV", "0")
    assert not norm_folds(lin, x, nw, False)


def test_fold_or_add_norm_hands_the_norm_to_a_consumer_that_folds_it():
    norm = FusedRMSNorm(nn.Parameter(torch.rand(64)), 1e-6)
    x, r = torch.randn(1, 1, 64), torch.randn(1, 1, 64)

    class Folds(nn.Module):
        def folds_norm(self, rows, weight, weight_then_cast):
            return weight is norm.weight and not weight_then_cast and rows.shape == (1, 1, 64)

    folded, summed = fold_or_add_norm(norm, x[0], r, Folds())
    assert isinstance(folded, FoldedNorm) and folded.weight is norm.weight and folded.eps == 1e-6
    assert folded.summed is summed and summed.shape == r.shape
    assert folded.x.shape == r.shape and torch.equal(folded.x, x) and folded.residual is r
    rows, residual_rows, summed_rows = folded.rows()
    assert rows.shape == residual_rows.shape == summed_rows.shape == (1, 64)
    assert summed_rows.data_ptr() == summed.data_ptr()
    ref = Qwen3MoeRMSNorm(64)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
    out, summed = fold_or_add_norm(ref, x, r, Folds())  # not a FusedRMSNorm: computed here
    assert torch.equal(summed, r + x) and torch.equal(out, ref(r + x))
    out, summed = fold_or_add_norm(ref, x, r, nn.Identity())  # no folds_norm
    assert torch.equal(summed, r + x) and torch.equal(out, ref(r + x))


def test_fold_or_add_norm_keeps_wide_rows_and_the_switch_off_to_the_norm(monkeypatch):
    """Rows wider than ``FOLD_NORM_MAX_WIDTH``, or ``EPMOE_FOLD_NORM=0``: the norm's own launch (``add_norm``),
    whatever the consumer says."""
    import epmoe.engine.decoder as decoder_mod

    monkeypatch.setattr(decoder_mod, "add_norm", lambda norm, x, r: ("added", r))

    class FoldsAny(nn.Module):
        def folds_norm(self, rows, weight, weight_then_cast):
            return True

    k = FOLD_NORM_MAX_WIDTH
    narrow = FusedRMSNorm(nn.Parameter(torch.rand(k)), 1e-6)
    wide = FusedRMSNorm(nn.Parameter(torch.rand(k + 64)), 1e-6)
    x, r = torch.randn(1, 1, k + 64), torch.randn(1, 1, k + 64)
    assert isinstance(fold_or_add_norm(narrow, x[..., :k], r[..., :k], FoldsAny())[0], FoldedNorm)
    assert fold_or_add_norm(wide, x, r, FoldsAny())[0] == "added"
    monkeypatch.setenv("EPMOE_FOLD_NORM", "0")
    assert fold_or_add_norm(narrow, x[..., :k], r[..., :k], FoldsAny())[0] == "added"
