"""trainguard: make training failures cheap.

``trainguard.core`` is framework-free; ``trainguard.torch`` (an alias of
``trainguard.adapters.torch``) is the PyTorch adapter.
"""

import os as _os

# gRPC's core prints an INFO line for every failed TLS handshake: one a
# connection, so anyone who reaches a TLS port fills the log. Its errors
# only, unless GRPC_VERBOSITY says otherwise (read when gRPC is imported,
# which trainguard does after this).
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"
__all__ = ["__version__"]
