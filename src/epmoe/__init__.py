"""epmoe: expert-parallel Mixture-of-Experts inference for PyTorch."""

__version__ = "0.1.0"
