"""Tensor dtypes as dcpctl knows them, by torch's name, without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dcpctl.errors import UnsupportedLayoutError


@dataclass(frozen=True)
class DType:
    """A torch dtype: its name in torch (`bfloat16`), bytes per element, safetensors code."""

    name: str
    itemsize: int
    safetensors_code: str | None
    is_floating_point: bool = False
    packed_values: int = 1
    """Values each element holds: 2 for float4_e2m1fn_x2, two 4-bit floats in a byte."""

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def safetensors_shape(self, sizes: Sequence[int]) -> tuple[int, ...] | None:
        """The shape a safetensors header gives a tensor of these sizes: it counts values, so
        a packed dtype's last size is torch's times the values each element packs (F4 [5, 4]
        for float4_e2m1fn_x2 [5, 2]). None where it has none: a 0-d tensor of packed values."""
        if self.packed_values == 1:
            return tuple(sizes)
        if not sizes:
            return None
        return (*sizes[:-1], sizes[-1] * self.packed_values)

    def sizes_of_safetensors_shape(self, shape: Sequence[int]) -> tuple[int, ...] | None:
        """torch's sizes of the tensor whose safetensors header gives this shape (see
        safetensors_shape); None where no tensor of this dtype has it (a last size that does
        not pack into whole elements)."""
        if self.packed_values == 1:
            return tuple(shape)
        if not shape or shape[-1] % self.packed_values:
            return None
        return (*shape[:-1], shape[-1] // self.packed_values)


_KNOWN_DTYPES = [
    DType("float64", 8, "F64", True),
    DType("float32", 4, "F32", True),
    DType("float16", 2, "F16", True),
    DType("bfloat16", 2, "BF16", True),
    DType("float8_e4m3fn", 1, "F8_E4M3", True),
    DType("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", True),
    DType("float8_e5m2", 1, "F8_E5M2", True),
    DType("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", True),
    DType("float8_e8m0fnu", 1, "F8_E8M0", True),
    DType("float4_e2m1fn_x2", 1, "F4", True, packed_values=2),
    DType("complex128", 16, None),
    DType("complex64", 8, "C64"),
    DType("complex32", 4, None),
    DType("int64", 8, "I64"),
    DType("int32", 4, "I32"),
    DType("int16", 2, "I16"),
    DType("int8", 1, "I8"),
    DType("uint64", 8, "U64"),
    DType("uint32", 4, "U32"),
    DType("uint16", 2, "U16"),
    DType("uint8", 1, "U8"),
    DType("bool", 1, "BOOL"),
]

DTYPES_BY_NAME: dict[str, DType] = {dtype.name: dtype for dtype in _KNOWN_DTYPES}
# torch also exposes dtypes under alias names (torch.half, torch.long); pickles use the
# canonical one.
DTYPE_ALIASES = {
    "half": "float16", "float": "float32", "double": "float64", "long": "int64",
    "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
    "chalf": "complex32",
}
DTYPES_BY_SAFETENSORS_CODE: dict[str, DType] = {
    dtype.safetensors_code: dtype for dtype in _KNOWN_DTYPES if dtype.safetensors_code
}


# The legacy storage class torch.save names in a tensor's pickle, which implies its dtype.
LEGACY_STORAGE_TYPES: dict[str, str] = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}


TORCH_INDEX_LIMIT = 1 << 63
"""torch counts sizes, elements and bytes in int64: no tensor it can hold reaches this."""


_UINT64_LIMIT = 1 << 64


def fits_in_torch(sizes: Sequence[int], itemsize: int) -> bool:
    """Whether torch can make a tensor of these sizes and bytes per element, as its own checks
    decide: every size, the element count and the byte count below 2**63, the element count
    multiplied out left to right in uint64 without overflowing on the way (so (2**32, 2**32,
    0), 0 elements, is refused: c10::safe_multiplies_u64), and each contiguous stride, the
    product of the later sizes with 0 taken as 1, below 2**63 (empty_tensor_restride)."""
    if not all(0 <= size < TORCH_INDEX_LIMIT for size in sizes):
        return False
    elements = 1
    for size in sizes:
        elements *= size
        if elements >= _UINT64_LIMIT:
            return False
    stride = 1
    for size in reversed(sizes[1:]):
        stride *= max(size, 1)
        if stride >= TORCH_INDEX_LIMIT:
            return False
    return elements * itemsize < TORCH_INDEX_LIMIT


def dtype_by_name(name: str) -> DType:
    """The DType torch calls `name` (`bfloat16`, `torch.bfloat16`, or an alias such as `half`)."""
    name = name.removeprefix("torch.")
    dtype = DTYPES_BY_NAME.get(DTYPE_ALIASES.get(name, name))
    if dtype is None:
        raise UnsupportedLayoutError(f"unsupported dtype torch.{name}")
    return dtype
