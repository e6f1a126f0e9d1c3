"""Float8 linear layers with delayed scaling: the "delayed" recipe of `convert_to_float8`.

Written here because the field lacks it in a form that can run here: torchao dropped delayed scaling,
and Transformer Engine (whose default Hopper recipe it is) is a CUDA build that cannot be installed
everywhere. Dynamic tensorwise scaling (torchao's "tensorwise") needs a tensor's amax before it can
cast it, so every activation and gradient is read twice and the cast cannot fuse into the kernel that
produced the tensor. Delayed scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") takes
each scale from the amaxes of the last `history_len` steps instead: under `torch.compile` the cast fuses
into its producer (the RMSNorm, the SwiGLU and their backwards) and the current amax is only recorded.

Per layer: inputs and weights in e4m3, output gradients in e5m2 (the "hybrid" format), scale
`max_representable / max(amax history)`, values beyond the range saturate. Linears that read the same
input (q/k/v, gate/up) share the input's scale, so the input is cast once for all of them. The first
step, with no history yet, scales dynamically; later steps never wait for an amax.

Bookkeeping: the forward writes the current input and weight amaxes to `amax_pending`; the backward
returns the output gradient's amax as the "gradient" of `grad_amax_sink` (a scalar buffer that requires
grad: a compiled backward hands out gradients, where mutating a buffer inside it is not supported), and
a hook on it, run once that gradient has been accumulated, writes all three into `amax_history` (a ring
of `history_len` steps). A forward without backward (evaluation) records nothing.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLOAT8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
INPUT, WEIGHT, GRAD = 0, 1, 2  # rows of the amax history
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _to_float8(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = FLOAT8_MAX[dtype]
    return (tensor.float() * scale).clamp(-limit, limit).to(dtype)


def _amax(tensor: torch.Tensor) -> torch.Tensor:
    """Largest magnitude, reduced per row first: Inductor then fuses the cast of a tensor (a pointwise op
    over the same rows) into the kernel that reduces it, where a single global reduction is split into
    blocks that the cast cannot join."""
    return tensor.abs().amax(dim=-1).amax()


def _scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return FLOAT8_MAX[dtype] / amax.float().clamp(min=1e-12)


def _pad_rows(tensor: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Float8 GEMMs need the contracted dimension a multiple of 16: the weight gradient contracts over
    tokens. Zero rows leave every product unchanged."""
    extra = -tensor.shape[0] % multiple
    return F.pad(tensor, (0, 0, 0, extra)) if extra else tensor


class _DelayedFloat8Linear(torch.autograd.Function):
    """`x @ weight.T` through float8 GEMMs. x_scale, w_scale, g_scale: fp32 scalars for the input, the
    weight and the output gradient, or None to scale each tensor by its own amax (the first step). Returns
    the output and the (2,) input / weight amaxes; the backward returns the output gradient's amax as the
    sink's gradient."""

    @staticmethod
    def forward(ctx, x, weight, x_scale, w_scale, g_scale, grad_amax_sink, out_dtype, fast_accum_backward):
        rows = x.reshape(-1, x.shape[-1])
        x_amax, w_amax = _amax(rows), _amax(weight)
        dynamic = x_scale is None
        if dynamic:
            x_scale, w_scale = _scale(x_amax, E4M3), _scale(w_amax, E4M3)
        x8 = _to_float8(_pad_rows(rows), x_scale, E4M3)
        w8 = _to_float8(weight, w_scale, E4M3)
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(),
                               out_dtype=out_dtype, use_fast_accum=True)
        amaxes = torch.stack([x_amax, w_amax]).float()
        ctx.mark_non_differentiable(amaxes)
        ctx.save_for_backward(x8, w8, x_scale, w_scale, g_scale)
        ctx.meta = (x.shape, x.dtype, weight.dtype, dynamic, fast_accum_backward)
        return out[: rows.shape[0]].reshape(*x.shape[:-1], -1), amaxes

    @staticmethod
    def backward(ctx, grad_out, _):
        x8, w8, x_scale, w_scale, g_scale = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, dynamic, fast = ctx.meta
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        g_amax = _amax(grad).float()
        if dynamic:
            g_scale = _scale(g_amax, E5M2)
        g8 = _to_float8(_pad_rows(grad), g_scale, E5M2)
        g_inverse = g_scale.reciprocal()
        # cuBLASLt float8 GEMMs take A row-major and B column-major: hence the transposed copies.
        # Only the gradients autograd asks for (a frozen weight, e.g. under LoRA, skips its GEMM).
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=g_inverse, scale_b=w_scale.reciprocal(),
                                      out_dtype=x_dtype if x_dtype in (torch.bfloat16, torch.float32) else torch.float32,
                                      use_fast_accum=fast)
            grad_x = grad_x[: grad.shape[0]].reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=g_inverse,
                                      scale_b=x_scale.reciprocal(), out_dtype=torch.float32, use_fast_accum=fast)
            grad_w = grad_w.to(w_dtype)
        return grad_x, grad_w, None, None, None, g_amax, None, None


class DelayedFloat8Linear(nn.Linear):
    """`nn.Linear` computed in float8 with delayed scaling (module docstring). Same parameters and
    state-dict keys as the `nn.Linear` it replaces; the amax bookkeeping lives in non-persistent buffers,
    so a checkpoint loads into a plain model. `float8_state_dict` (saved by DLMTrainer's checkpoints)
    carries the histories for an exact resume."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 history_len: int = 16, fast_accum_backward: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if in_features % 16 or out_features % 16:
            raise ValueError(f"float8 linear layers need in and out features divisible by 16, got "
                             f"({in_features}, {out_features})")
        self.history_len, self.fast_accum_backward = history_len, fast_accum_backward
        self.scales_ready = False  # a Python flag: torch.compile guards on it and recompiles once
        self._history_step = 0
        object.__setattr__(self, "_input_owner", None)  # a sibling whose input scale this one shares
        self._hooked_sink = None
        self._init_bookkeeping(self.weight.device)

    def _init_bookkeeping(self, device) -> None:
        self.register_buffer("amax_history", torch.zeros(3, self.history_len, device=device), persistent=False)
        self.register_buffer("amax_pending", torch.zeros(3, device=device), persistent=False)
        self.register_buffer("grad_amax_sink", torch.zeros((), device=device, requires_grad=True), persistent=False)
        self._hook_sink()

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "DelayedFloat8Linear":
        """The layer over `linear`'s own parameters (built on the meta device: no second weight allocated)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)
        new.weight, new.bias = linear.weight, linear.bias
        new._init_bookkeeping(linear.weight.device)
        return new

    def share_input_scale_with(self, owner: "DelayedFloat8Linear") -> None:
        """Use `owner`'s input scale (both read the same input tensor): the input is cast once."""
        object.__setattr__(self, "_input_owner", owner)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._hook_sink()  # `.to()` / `.cuda()` replace the buffer, and a hook belongs to the tensor
        return result

    def _hook_sink(self) -> None:
        sink = self._buffers.get("grad_amax_sink")
        if sink is None or sink is self._hooked_sink or sink.is_meta:
            return
        if sink.grad_fn is not None:  # `_apply` converts buffers differentiably: keep the sink a leaf
            sink = self._buffers["grad_amax_sink"] = sink.detach()
        sink.requires_grad_(True)
        module = weakref.ref(self)
        sink.register_post_accumulate_grad_hook(lambda tensor: module() and module()._record_step(tensor))
        self._hooked_sink = sink

    @torch.no_grad()
    def _record_step(self, sink: torch.Tensor) -> None:
        """After this layer's backward: the step's three amaxes overwrite the oldest column of the history
        (a ring: the scale takes the maximum over all columns, so their order does not matter, and two
        small kernels per layer keep the backward's launch stream short)."""
        column = self._history_step % self.history_len
        self.amax_history[:, column] = torch.stack((self.amax_pending[INPUT], self.amax_pending[WEIGHT], sink.grad))
        self._history_step += 1
        sink.grad = None
        self.scales_ready = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        owner = self._input_owner if self._input_owner is not None else self
        ready = self.scales_ready and owner.scales_ready
        x_scale = w_scale = g_scale = None
        if ready:  # separate expressions, so the input cast of siblings is one node after CSE
            x_scale = _scale(owner.amax_history[INPUT].amax(), E4M3)
            w_scale = _scale(self.amax_history[WEIGHT].amax(), E4M3)
            g_scale = _scale(self.amax_history[GRAD].amax(), E5M2)
        out, amaxes = _DelayedFloat8Linear.apply(x, self.weight, x_scale, w_scale, g_scale, self.grad_amax_sink,
                                                 out_dtype, self.fast_accum_backward)
        with torch.no_grad():
            self.amax_pending[:2].copy_(amaxes)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8=delayed, history_len={self.history_len}"


def convert_to_delayed_float8(model: nn.Module, names: list[str], history_len: int = 16,
                              fast_accum_backward: bool = False) -> None:
    """Swap the named `nn.Linear`s of `model` for `DelayedFloat8Linear` in place (same parameters), and
    let siblings that read the same input (`SHARED_INPUT_GROUPS`) share its scale."""
    converted = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = DelayedFloat8Linear.from_linear(getattr(parent, child), history_len=history_len,
                                                fast_accum_backward=fast_accum_backward)
        setattr(parent, child, layer)
        converted[name] = layer
    for name, layer in converted.items():
        parent_name, _, child = name.rpartition(".")
        for group in SHARED_INPUT_GROUPS:
            owner = f"{parent_name}.{group[0]}" if parent_name else group[0]
            if child in group[1:] and owner in converted:
                layer.share_input_scale_with(converted[owner])


def float8_state_dict(model: nn.Module) -> dict:
    """The amax histories of `model`'s delayed-scaling layers, by module name (empty without such layers):
    what a checkpoint needs, beyond the weights, for a resumed run to scale exactly as the uninterrupted one."""
    return {name: {"amax_history": module.amax_history.detach().cpu().clone(), "step": module._history_step,
                   "ready": module.scales_ready}
            for name, module in model.named_modules() if isinstance(module, DelayedFloat8Linear)}


def load_float8_state_dict(model: nn.Module, state: dict) -> None:
    """Restore `float8_state_dict`'s output into a model converted the same way; a name that is missing
    on either side is an error naming it."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, DelayedFloat8Linear)}
    if set(layers) != set(state):
        missing, unexpected = sorted(set(layers) - set(state)), sorted(set(state) - set(layers))
        raise KeyError(f"float8 state does not match the model's delayed-scaling layers: missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, module in layers.items():
            module.amax_history.copy_(state[name]["amax_history"])
            module._history_step, module.scales_ready = state[name]["step"], state[name]["ready"]
