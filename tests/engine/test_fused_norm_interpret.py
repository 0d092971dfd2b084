"""``FusedRMSNorm``'s residual add under the Triton interpreter on CPU: the sum is the add's, the normalised rows
the module's (``add_forward``, what ``decoder.add_norm`` runs on CUDA)."""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from epmoe.engine.decoder import add_norm
from epmoe.engine.fused_norm import FusedRMSNorm

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter has no bf16
def test_add_forward_matches_add_then_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    d = 96  # not a power of two: the masked columns
    ref = Qwen3MoeRMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    fused = FusedRMSNorm(ref.weight, 1e-6)
    x = (torch.randn(1, 3, d, generator=gen) * 3).to(dtype)
    r = (torch.randn(1, 3, d, generator=gen) * 5).to(dtype)
    got, summed = fused.add_forward(x, r)
    assert torch.equal(summed, r + x)
    torch.testing.assert_close(got, ref(r + x), rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=1e-5)
    # a flattened block output ([T, D], as MoE layers return) against the [1, T, D] residual: the residual's shape
    want_out, want_sum = add_norm(ref, x[0], r)
    assert want_sum.shape == r.shape and torch.equal(want_sum, r + x) and torch.equal(want_out, ref(r + x))
    with pytest.raises(ValueError, match="residual .* does not match the rows"):
        fused.add_forward(x, r.float() if dtype == torch.float16 else r.double())
