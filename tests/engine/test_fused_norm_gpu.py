"""``FusedRMSNorm`` equals the transformers RMSNorm it replaces (both styles), on CUDA."""

import pytest
import torch

from epmoe.engine.fused_norm import FusedRMSNorm, fuse_norms

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cls_path", ["transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
                                      "transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm",
                                      "transformers.models.llama4.modeling_llama4.Llama4TextRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 3, 2048), (5, 4, 128), (0, 7168)])
def test_fused_equals_transformers(cls_path, dtype, shape):
    import importlib

    mod, _, name = cls_path.rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    d = shape[-1]
    ref = cls(d, eps=1e-6).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(d, device="cuda") + 0.5)
    holder = torch.nn.Sequential(ref)
    assert fuse_norms(holder) == 1 and isinstance(holder[0], FusedRMSNorm)
    x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
    want = ref(x)
    got = holder[0](x)
    assert got.dtype == want.dtype and got.shape == want.shape
    if x.numel():
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-6), err


@pytest.mark.parametrize("cls_path", ["transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
                                      "transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_forward_equals_the_add_and_the_module(cls_path, dtype):
    """The fused residual add: the sum bitwise equal to ``residual + x`` (rounded in the rows' dtype), the normalised
    rows as the module's on that sum."""
    import importlib

    mod, _, name = cls_path.rpartition(".")
    d = 2048
    ref = getattr(importlib.import_module(mod), name)(d, eps=1e-6).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(d, device="cuda") + 0.5)
    fused = FusedRMSNorm(ref.weight, 1e-6, name == "GptOssRMSNorm")
    x = torch.randn(1, 5, d, device="cuda", dtype=dtype) * 3
    r = torch.randn(1, 5, d, device="cuda", dtype=dtype) * 5
    got, summed = fused.add_forward(x, r)
    assert torch.equal(summed, r + x)
    want = ref(r + x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < (1e-2 if dtype == torch.bfloat16
                                                                                   else 1e-6)
