"""The dtype names driftcheck reads and writes, torch-free: a trace's dtype names and their
safetensors codes, and the short names the command line takes. numerics/dtypes.py turns them
into torch dtypes; processes that must not import torch (``driftcheck run``'s orchestrator, the
manifest validator) read them here."""
from __future__ import annotations

# The dtypes a trace stores (a trace names them as torch does, minus "torch.") and their codes in
# the safetensors file format. complex128 is not among them: the writer refuses it with a hint.
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "int64": "I64", "int32": "I32", "int16": "I16",
    "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
}
CODE_NAMES = {code: name for name, code in SAFETENSORS_CODES.items()}
TRACE_DTYPES = tuple(SAFETENSORS_CODES)
FLOAT_NAMES = frozenset(TRACE_DTYPES[:8])

# The short names the command line takes (--dtype, --reference-dtype, --target-dtype), by the
# trace name of the dtype each one means.
CLI_DTYPE_NAMES: dict[str, str] = {
    "fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "fp64": "float64", "float64": "float64"}
