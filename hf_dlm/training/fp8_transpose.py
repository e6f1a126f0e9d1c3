"""Transposed copies of float8 tensors for the weight-gradient GEMMs of `fp8_delayed`.

cuBLASLt float8 GEMMs take A row-major and B column-major, so the weight gradient needs the output
gradient and the input with tokens as the contiguous dimension. Written as `t.t().contiguous()` inside
the compiled backward, Inductor folds that copy into the reduction kernel that produces the float8
tensor (the SwiGLU or RMSNorm backward with its row-wise amax), where each program writes one row and
the transposed stores cannot be coalesced. `transpose_2d` is an opaque custom op instead: a tiled Triton
kernel (read a tile along rows, store it along columns) on CUDA, `t.t().contiguous()` elsewhere. The
field lacks a float8 cast-transpose outside Transformer Engine, hence the small kernel here.
"""

from __future__ import annotations

import os

import torch

from ..utils.import_utils import is_triton_available

_BLOCK = 64


def _launch_tiled_transpose(src: torch.Tensor, dst: torch.Tensor) -> None:
    import triton
    import triton.language as tl

    global _transpose_kernel
    if _transpose_kernel is None:

        @triton.jit
        def kernel(src_ptr, dst_ptr, rows, cols, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
            r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
            c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            tile = tl.load(src_ptr + r[:, None] * stride_r + c[None, :] * stride_c,
                           mask=(r[:, None] < rows) & (c[None, :] < cols))
            tl.store(dst_ptr + c[:, None] * rows + r[None, :], tl.trans(tile),
                     mask=(c[:, None] < cols) & (r[None, :] < rows))

        _transpose_kernel = kernel
    rows, cols = src.shape
    grid = (triton.cdiv(rows, _BLOCK), triton.cdiv(cols, _BLOCK))
    _transpose_kernel[grid](src, dst, rows, cols, src.stride(0), src.stride(1), BLOCK_R=_BLOCK, BLOCK_C=_BLOCK)


_transpose_kernel = None


@torch.library.custom_op("hf_dlm::transpose_2d", mutates_args=())
def transpose_2d(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.t().contiguous()` for a 2-D tensor (float8 is copied as bytes)."""
    if tensor.dim() != 2:
        raise ValueError(f"transpose_2d takes a 2-D tensor, got shape {tuple(tensor.shape)}")
    use_triton = tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs on CPU
    if use_triton and is_triton_available() and tensor.numel():
        out = torch.empty(tensor.shape[1], tensor.shape[0], dtype=tensor.dtype, device=tensor.device)
        as_bytes = tensor.element_size() == 1  # Triton's float8 types differ by GPU; bytes copy everywhere
        _launch_tiled_transpose(tensor.view(torch.uint8) if as_bytes else tensor,
                                out.view(torch.uint8) if as_bytes else out)
        return out
    return tensor.t().contiguous()


@transpose_2d.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.new_empty(tensor.shape[1], tensor.shape[0])
