"""The one table of the float formats the protocol (and so the store) knows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsdump._exceptions import (
    DtypeMismatch,
    InputError,
)
from hsdump._protocol._names import DType

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch


@dataclass(frozen=True)
class DtypeSpec:
    """How one protocol dtype is held on disk, in numpy and in torch.

    numpy has no bfloat16 and zarr neither, so every reader (the client's, the store's) holds a
    tensor's values as their raw bits, an unsigned integer of the same width, whatever the float
    format: one representation, bit-exact (NaN payloads included), viewed as floats only where
    torch tensors are handed out.

    Attributes:
        name: The protocol name (``meta.json``'s ``dtype``).
        itemsize: Bytes per element.
        bits: numpy's name of the unsigned integer that holds the bits.
        torch_name: torch's name of the float dtype (``getattr(torch, torch_name)``).
        torch_bits: torch's name of the integer the bits are viewed through on the way in and out
            (``int32`` for 4 bytes: torch's ``uint32`` arrived only in 2.3, with few kernels).
        exponent_mask: The exponent's bits. Without the sign, a value's bits order like its
            magnitude and reach this mask exactly when it is Inf or NaN.
    """

    name: DType
    itemsize: int
    bits: str
    torch_name: str
    torch_bits: str
    exponent_mask: int

    @property
    def magnitude_mask(self) -> int:
        """Every bit but the sign."""
        return (1 << (8 * self.itemsize - 1)) - 1

    @property
    def bits_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the bits."""
        import numpy as np

        return np.dtype(self.bits)

    def peak_magnitude(self, bits: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
        """The largest magnitude along ``axis`` (not empty), as bits without the sign: Inf and
        NaN reach `exponent_mask`, 0 means all zeros (``-0.0`` included).

        Two maxima of views, no masked copy (0.10-0.15 against 0.13-0.18 core-s per GB in
        benchmarks/bench_store_steps.py): read unsigned, the largest bits belong to the largest
        negative magnitude when any value is negative; read signed, to the largest positive
        magnitude when any value is positive.
        """
        return self.peak_of(bits.max(axis=axis), bits.view(f"i{self.itemsize}").max(axis=axis))

    def peak_of(self, unsigned_max: np.ndarray, signed_max: np.ndarray) -> np.ndarray:
        """`peak_magnitude` from the two maxima of the bits, read unsigned and read signed."""
        import numpy as np

        unsigned = np.bitwise_and(unsigned_max, self.magnitude_mask)
        peak: np.ndarray = np.maximum(unsigned, np.maximum(signed_max, 0).astype(unsigned.dtype))
        return peak

    def torch_dtype(self) -> torch.dtype:
        """The torch float dtype (imports torch)."""
        import torch

        dtype: torch.dtype = getattr(torch, self.torch_name)
        return dtype

    def bits_of(self, tensor: torch.Tensor, *, strided: bool = False) -> np.ndarray:
        """A CPU numpy view of ``tensor``'s bits (a copy only off the CPU, or when strided unless
        ``strided`` allows a strided view)."""
        import torch

        t = tensor.detach().to("cpu")
        t = t if strided else t.contiguous()
        if t.dtype != self.torch_dtype():
            raise DtypeMismatch(f"a {t.dtype} tensor is not {self.name}: cast it first")
        return t.view(getattr(torch, self.torch_bits)).numpy().view(self.bits)

    def tensor_of(self, bits: np.ndarray) -> torch.Tensor:
        """Reinterpret bits as a tensor of this dtype without copying."""
        import torch

        return torch.from_numpy(bits.view(self.torch_bits)).view(self.torch_dtype())

    def to_float32(self, bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The values of ``bits`` as float32 (a view for float32 itself).

        ``out``, a float32 array of ``bits``' shape, receives them instead of fresh memory (a
        buffer reused block after block saves its page faults); float32 bits are viewed as is.
        """
        import numpy as np

        if self.name == "float32":
            return bits.view(np.float32)
        if out is None:
            out = np.empty(bits.shape, np.float32)
        if self.name == "bfloat16":  # one ufunc pass (astype then shift made two, 4.8x slower)
            np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
        else:
            np.copyto(out, bits.view(self.torch_name))
        return out

    def from_float32(self, values: npt.ArrayLike) -> np.ndarray:
        """The bits of float32 ``values`` in this dtype, rounded to nearest even."""
        import numpy as np

        wide = np.asarray(values, dtype=np.float32)
        if self.name != "bfloat16":
            with np.errstate(over="ignore"):  # beyond the format's range is Inf, as in torch
                return wide.astype(self.torch_name).view(self.bits)
        u = wide.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


#: Every float format the protocol (and so the store) knows, by protocol name.
DTYPES: dict[str, DtypeSpec] = {
    "bfloat16": DtypeSpec("bfloat16", 2, "uint16", "bfloat16", "uint16", 0x7F80),
    "float16": DtypeSpec("float16", 2, "uint16", "float16", "uint16", 0x7C00),
    "float32": DtypeSpec("float32", 4, "uint32", "float32", "int32", 0x7F800000),
}


def dtype_spec(name: str) -> DtypeSpec:
    """The table entry of protocol dtype ``name``.

    Raises:
        DtypeMismatch: ``name`` is not a protocol dtype.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise DtypeMismatch(
            f"dtype {name!r} is not a protocol dtype: use one of {', '.join(DTYPES)}"
        ) from None


def dtype_of_torch(dtype: torch.dtype) -> DtypeSpec:
    """The table entry of a torch float dtype.

    Raises:
        InputError: The protocol has no such dtype (cast the tensors to one it has).
    """
    name = str(dtype).removeprefix("torch.")
    spec = DTYPES.get(name)
    if spec is None or spec.torch_name != name:
        raise InputError(
            f"hidden states of dtype {name} cannot be dumped or stored: cast them to one of "
            f"{', '.join(DTYPES)}"
        )
    return spec


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a protocol dtype name."""
    return dtype_spec(dtype).itemsize
