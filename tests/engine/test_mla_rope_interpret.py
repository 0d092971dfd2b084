"""``mla_rope_write``'s Triton kernel under the Triton interpreter (CPU; runs only with ``TRITON_INTERPRET=1``).

    PYTHONPATH=/tmp/np23 TRITON_INTERPRET=1 python -m pytest -q tests/engine/test_mla_rope_interpret.py

(``/tmp/np23``: numpy<2.4, see ``test_paged_decode_interpret``.) The kernel against ``mla_rope_write_reference``
on the shared cases, float32 and float16 (the interpreter has no bf16): the rotated queries (their other values
untouched), the latent entries at the step's slots and nothing elsewhere in the pool.
"""

import pytest
import torch

from epmoe.engine.mla_rope import mla_rope_write_reference, mla_rope_write_triton

from .mla_rope_cases import CASES, make_mla_rope_case

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("heads_per_program", [None, 2, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, dtype, heads_per_program):
    """Every case with one head a program (the small batches' choice), two (a model whose heads do not fill the
    last program: 3 heads) and sixteen (more than most cases have)."""
    t, h, dn, dr, rank, interleave = case
    q, compressed, cos, sin, weight, pool, slots = make_mla_rope_case(t, h, dn, dr, rank, dtype)
    want_q, want_pool = q.clone(), pool.clone()
    mla_rope_write_reference(want_q, compressed, cos, sin, weight, 1e-6, want_pool, slots, dn, interleave)
    nope = q[..., :dn].clone()
    mla_rope_write_triton(q, compressed, cos, sin, weight, 1e-6, pool, slots, dn, interleave, heads_per_program)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    assert torch.equal(q[..., :dn], nope)
    torch.testing.assert_close(pool, want_pool, rtol=tol, atol=tol)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not pool[untouched].any()
