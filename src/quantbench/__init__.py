"""quantbench: recipe-driven quantization, evaluation and tracking."""

__version__ = "0.1.0"
