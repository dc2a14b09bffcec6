"""Argument validation shared by every public op: one way to check a tensor, one way to word the error.

Every check raises before any work is done. ``TypeError`` is for a wrong Python type or dtype, ``ValueError`` for
a wrong shape, device, layout or value. Messages name the argument, what was given and what was expected.
Nothing here reads tensor *values* (no host sync): ops stay capturable in CUDA graphs and traceable by
``torch.compile``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = ["check_tensor", "check_same_device", "check_choice", "check_positive_int", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fmt_shape(shape: Sequence) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    x,
    *,
    ndim: int | Iterable[int] | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    optional: bool = False,
):
    """Validate one tensor argument and return it.

    ``shape`` entries of ``None`` match any size. ``device`` requires the same device as that tensor's.
    ``last_dim_contiguous`` requires stride 1 in the last dim (other strides are free), and the data pointer
    aligned to the element size.
    """
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a torch.Tensor, got None")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    # plain loops and early exits: every public call runs several of these (host time of decode-sized calls)
    if dtypes is not None:
        if not isinstance(dtypes, tuple):
            dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            want = " or ".join(dtype_name(d) for d in dtypes)
            raise TypeError(f"{name}: expected dtype {want}, got {dtype_name(x.dtype)}")
    if shape is not None:
        got = x.shape
        ok = len(got) == len(shape)
        if ok:
            for w, g in zip(shape, got):
                if w is not None and w != g:
                    ok = False
                    break
        if not ok:
            raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {_fmt_shape(tuple(x.shape))}")
    elif ndim is not None:
        nd = x.dim()
        if nd != ndim if isinstance(ndim, int) else nd not in tuple(ndim):
            allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name}: expected a {want}-D tensor, got {nd}-D with shape {_fmt_shape(tuple(x.shape))}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (like the other inputs), got one on {x.device}")
    if last_dim_contiguous and x.dim() > 0 and x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(x.stride())}")
    return x


def check_same_device(**tensors) -> torch.device:
    """All non-None tensors on one device; returns it."""
    dev = None
    first = None
    for n, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, n
        elif t.device != dev:
            raise ValueError(f"{n}: expected a tensor on {dev} (the device of {first}), got one on {t.device}")
    return dev


def check_choice(name: str, value, choices: Sequence):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_float(name: str, value, *, positive: bool = True, optional: bool = True):
    if value is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a float, got None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    if positive and not (value > 0 and value < float("inf")):
        raise ValueError(f"{name}: expected a finite float > 0, got {value}")
    return value
