"""Packed low-precision weight formats (pure-torch reference): int4 group, fp8 block, mxfp4, nvfp4, nf4.

Each module's docstring documents its packed layout, which the Triton kernels read as is.
Importing this package registers every format with `get_format` (each module registers itself).
"""

from .e2m1 import decode_e2m1, e2m1_values, encode_e2m1
from .fp8 import Fp8BlockFormat
from .hf_config import (
    format_from_quantization_config,
    fp8_from_quantization_config,
    int4_from_quantization_config,
)
from .int4 import INT4_LAYOUTS, Int4Format, int4_storage_name, pack_int4, unpack_int4
from .metrics import bytes_per_param, print_error_table, quantization_error
from .mxfp4 import MXFP4Format
from .nf4 import NF4Format
from .nvfp4 import NVFP4Format
from .packing import pack_nibbles, unpack_nibbles
from .registry import FORMATS, QuantFormat, get_format, index_leading, register_format

__all__ = [
    "FORMATS",
    "INT4_LAYOUTS",
    "Fp8BlockFormat",
    "Int4Format",
    "MXFP4Format",
    "NF4Format",
    "NVFP4Format",
    "QuantFormat",
    "bytes_per_param",
    "decode_e2m1",
    "e2m1_values",
    "encode_e2m1",
    "format_from_quantization_config",
    "fp8_from_quantization_config",
    "get_format",
    "index_leading",
    "int4_from_quantization_config",
    "int4_storage_name",
    "pack_int4",
    "pack_nibbles",
    "print_error_table",
    "quantization_error",
    "register_format",
    "unpack_int4",
    "unpack_nibbles",
]
