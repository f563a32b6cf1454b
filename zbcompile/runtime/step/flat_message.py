"""One buffer per message: the tensors a message carries, laid end to end as bytes, so that a
message is one send and one receive whatever it holds (an activation and a mask, a hidden state
in bf16 beside a float32 residual). A message of one tensor is that tensor itself, uncopied.

The layout is fixed by the tensors' shapes and dtypes alone (the compile fixes them), so both
ends compute it apart: each tensor starts at a multiple of `ALIGN` bytes, which keeps every view
of the buffer aligned for its dtype. The bytes are the tensors' own: what arrives is bitwise what
was sent."""

from __future__ import annotations

from typing import Sequence

import torch

ALIGN = 16
TensorLayout = tuple[torch.Size, torch.dtype]  # a tensor's shape and dtype in a message


def offsets(layouts: Sequence[TensorLayout]) -> tuple[list[int], int]:
    """Byte offset of each tensor of `layouts` in the buffer, and the buffer's size in bytes."""
    places, end = [], 0
    for shape, dtype in layouts:
        start = -(-end // ALIGN) * ALIGN
        places.append(start)
        end = start + torch.Size(shape).numel() * dtype.itemsize
    return places, end


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The message's one buffer: the tensor itself (made contiguous) when there is one, else the
    tensors' bytes copied into one uint8 buffer in `offsets`' layout."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    places, size = offsets([(t.shape, t.dtype) for t in tensors])
    flat = torch.zeros(size, dtype=torch.uint8, device=tensors[0].device)
    for tensor, start in zip(tensors, places):
        data = tensor.detach().reshape(-1).view(torch.uint8)
        flat[start : start + data.numel()].copy_(data)
    return flat


def empty(layouts: Sequence[TensorLayout], device: torch.device | str) -> torch.Tensor:
    """An uninitialised buffer for a message of `layouts` (see `pack`)."""
    if len(layouts) == 1:
        shape, dtype = layouts[0]
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty(offsets(layouts)[1], dtype=torch.uint8, device=device)


def unpack(flat: torch.Tensor, layouts: Sequence[TensorLayout]) -> list[torch.Tensor]:
    """The message's tensors: views of `flat`, no copy (see `pack`)."""
    if len(layouts) == 1:
        return [flat]
    places, _ = offsets(layouts)
    out = []
    for (shape, dtype), start in zip(layouts, places):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append(flat[start : start + nbytes].view(dtype).view(shape))
    return out
