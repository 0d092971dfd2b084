"""``fuse_norms`` on CPU: which modules it replaces, the weights shared, and which norms let their dependent
launches start only after their input is complete (a decoder layer's ``input_layernorm``)."""

from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from epmoe.engine.fused_norm import FusedRMSNorm, fuse_norms


def test_fuse_norms_replaces_the_norms_and_marks_the_input_norms():
    layer = nn.Module()
    layer.input_layernorm = Qwen3MoeRMSNorm(8, eps=1e-5)
    layer.post_attention_layernorm = Qwen3MoeRMSNorm(8, eps=1e-6)
    layer.proj = nn.Linear(8, 8)
    model = nn.Sequential(layer, Qwen3MoeRMSNorm(8))
    weight = layer.input_layernorm.weight
    assert fuse_norms(model) == 3
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and layer.input_layernorm.weight is weight
    assert layer.input_layernorm.eps == 1e-5 and layer.post_attention_layernorm.eps == 1e-6
    assert layer.input_layernorm.late_dependents
    assert not layer.post_attention_layernorm.late_dependents and not model[1].late_dependents
    assert isinstance(layer.proj, nn.Linear)
    assert fuse_norms(model) == 0  # nothing left to replace
