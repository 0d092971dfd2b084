"""``rope_qkv``'s Triton kernel under the Triton interpreter (CPU; runs only with ``TRITON_INTERPRET=1``).

    PYTHONPATH=/tmp/np23 TRITON_INTERPRET=1 python -m pytest -q tests/engine/test_rope_attention_interpret.py

(``/tmp/np23``: numpy<2.4, see ``test_paged_decode_interpret``.) The kernel against ``rope_qkv_reference`` on
the shared cases, float32 and float16 (the interpreter has no bf16).
"""

import pytest
import torch

from epmoe.engine.rope_attention import rope_qkv_reference, rope_qkv_triton

from .rope_cases import CASES, make_rope_case

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("tokens", [1, 4])  # a program a token; 4 tokens a program (the last program's 1 of 4 used)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, dtype, tokens, monkeypatch):
    from epmoe.engine import rope_attention

    monkeypatch.setattr(rope_attention, "ROPE_PREFILL_MIN_ROWS", 1 if tokens > 1 else 10**9)
    monkeypatch.setattr(rope_attention, "ROPE_PREFILL_TOKENS", tokens)
    h, hkv = case[0], case[1]
    qkv, cos, sin, qn, kn, kc, vc, slots = make_rope_case(*case, dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    want = rope_qkv_reference(qkv, cos, sin, h, hkv, qn, kn, 1e-6, ref_k, ref_v, slots)
    got = rope_qkv_triton(qkv, cos, sin, h, hkv, qn, kn, 1e-6, kc, vc, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(kc, ref_k, rtol=tol, atol=tol)
    assert torch.equal(vc, ref_v)
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(-1, hkv, kc.shape[-1])[untouched].any() and not vc.view(-1, hkv, vc.shape[-1])[untouched].any()
