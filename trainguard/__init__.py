"""trainguard: make training failures cheap.

``trainguard.core`` is framework-free; ``trainguard.torch`` (an alias of
``trainguard.adapters.torch``) is the PyTorch adapter.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
