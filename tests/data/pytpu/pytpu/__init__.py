"""pytpu: a PrivateUse1 backend renamed "tpu", registered from Python (driftcheck's tests only).

Tensors on "tpu" hold no memory of their own: each has a PrivateUse1 storage that owns nothing
(made by ``torch._C._construct_storage_from_data_pointer`` over a CPU storage's address and size, so
``data_ptr()`` and ``nbytes()`` tell what they tell on any device), and a table maps it to the CPU
storage that holds the bytes. The tensor's own sizes, strides and offset
say where it lies in that CPU storage, so the C++ code that makes views and shallow copies
(``alias``, ``.data``, ``detach``) keeps working. Every ATen op that reaches the PrivateUse1 key
runs the CPU kernel on those CPU views; float32 matmuls run as torch_tpu's default "medium"
precision does: one bf16 pass (operands rounded to bf16, products accumulated in fp32).

Loaded by ``import torch`` through the ``torch.backends`` entry point ``pytpu = "pytpu:autoload"``;
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` keeps it out of a process.
"""
from __future__ import annotations

__version__ = "0.1.0"
_loaded = False


def autoload() -> None:
    """Register the backend (the ``torch.backends`` entry point; idempotent)."""
    global _loaded
    if not _loaded:
        from pytpu import backend

        backend.register()
        _loaded = True
