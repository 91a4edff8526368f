"""Backward formulas whose eager path the tracer cannot take by itself.

PyTorch's C++ backward formulas (torch/csrc/autograd/FunctionsManual.cpp) test `isTensorSubclassLike`,
which holds for every tensor while a Python dispatch mode is on (ATen/TensorSubclassLikeUtils.h), and
so for the whole traced step: they then take their composite-compliant paths, which allocate otherwise
than eager's (an out-of-place chain where eager writes in place, a zero-safe product where eager
divides). For the ops here the tracer runs the op through an autograd.Function whose forward is the
same aten op, which saves what eager's node saves, and whose backward is eager's path for real
tensors, op for op (each cites its function). Where eager reads a value back to pick its path (are
there zeros?), the backward makes the same tensors and takes the typical answer, without reading.

The tracer applies these only where eager itself would take that path: gradients wanted, real floating
point CPU operands that are plain tensors (not functorch's), and autocast casting the op not at all or to
float32 (the casts are then made as autocast's kernel makes them). A dispatch mode on in forward (a
selective checkpoint's policy) does not matter: eager's backward runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from memplan.autocast import autocast_policy, cast_arguments, without_autocast

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _plain(ops: tuple[str, ...], *tensors: Any) -> bool:
    """Real floating point CPU tensors, some needing a gradient, grad mode on, and autocast casting the
    aten `ops` not at all or to float32 (`_apply` casts as its kernel would)."""
    present = [t for t in tensors if t is not None]
    return (torch.is_grad_enabled()
            and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu"
                    for t in present)
            and any(t.requires_grad for t in present)
            and all(autocast_policy(op) in (None, "fp32") for op in ops))


def _apply(function: type[torch.autograd.Function], ops: tuple[str, ...], tensors: tuple, *rest: Any) -> Any:
    """`function.apply(*tensors, *rest)` as eager's op runs: where autocast's fp32 policy names the op,
    its kernel casts the eligible tensors to float32 (ops in the graph, as here) and runs the op unseen
    by autocast; casting inside the Function instead would hide the casts from autograd."""
    if all(autocast_policy(op) is None for op in ops):
        return function.apply(*tensors, *rest)
    tensors, _ = cast_arguments(torch.float32, tensors, {})
    with without_autocast():
        return function.apply(*tensors, *rest)


class _Cumprod(torch.autograd.Function):
    """CumprodBackward0: cumprod_backward. Without zeros in the input (`is_zero.any().item()` false):
    `w = output * grad`, reversed_cumsum(w) (flip, cumsum, flip), divided by the input."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, dim: int) -> torch.Tensor:
        output = torch.cumprod(input, dim)
        ctx.dim = dim % input.dim()
        ctx.save_for_backward(input, output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        input, output = ctx.saved_tensors
        if input.numel() <= 1 or input.shape[ctx.dim] == 1:
            return grad, None
        w = output * grad
        is_zero = input == 0
        is_zero.any()  # eager reads it back
        # reversed_cumsum: C++ frees the flip and the sum it returns through at the end of its return
        flipped = w.flip(ctx.dim)
        summed = flipped.cumsum(ctx.dim)
        reversed_sum = summed.flip(ctx.dim)
        del flipped, summed
        return reversed_sum.div(input), None


def cumprod(input: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None, out: Any = None) -> torch.Tensor:
    if (out is not None or (dtype is not None and dtype != input.dtype) or not isinstance(dim, int)
            or input.dim() == 0 or not _plain(("cumprod",), input)):
        return torch.cumprod(input, dim, dtype=dtype, out=out)
    return _apply(_Cumprod, ("cumprod",), (input,), dim)


class _Prod(torch.autograd.Function):
    """ProdBackward0/1: prod_backward. Over all elements, `(input == 0).nonzero()` is empty and the
    gradient is `grad * (result / input)`; over a dimension, `zero_mask = input == 0`, its count per
    slice and in all (read back: zero), then the same quotient."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, dim: int | None, keepdim: bool) -> torch.Tensor:
        result = torch.prod(input) if dim is None else torch.prod(input, dim, keepdim)
        ctx.dim, ctx.keepdim = (None if dim is None else dim % input.dim()), keepdim
        ctx.save_for_backward(input, result)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        input, result = ctx.saved_tensors
        if input.dim() == 0:
            return grad, None, None
        if ctx.dim is None:
            input == 0  # noqa: B015 - eager's `(input == 0).nonzero()`: a mask, then nothing
            return grad * (result / input), None, None
        if not ctx.keepdim:
            grad, result = grad.unsqueeze(ctx.dim), result.unsqueeze(ctx.dim)
        zero_mask = input == 0
        slice_zero_count = zero_mask.sum(ctx.dim, True)
        slice_zero_count.sum()  # eager reads it back
        return grad * (result / input), None, None


def prod(input: torch.Tensor, dim: int | None = None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    if ((dtype is not None and dtype != input.dtype) or not isinstance(dim, (int, type(None)))
            or input.dim() == 0 or not _plain(("prod", "prod.dim_int"), input)):
        if dim is None:
            return torch.prod(input, dtype=dtype)
        return torch.prod(input, dim, keepdim, dtype=dtype)
    return _apply(_Prod, ("prod", "prod.dim_int"), (input,), dim, keepdim)


class _BinaryCrossEntropyWithLogits(torch.autograd.Function):
    """BinaryCrossEntropyWithLogitsBackward0: binary_cross_entropy_with_logits_backward, whose plain
    path writes its result in place: `t = pos_weight.mul(target); t.add(1).sub_(target).mul_(
    input.sigmoid()).sub_(t)` (or `input.sigmoid().sub_(target)`), `.mul_(grad)`, `.mul_(weight)`,
    `.div_(numel)` for the mean. Under grad mode (a double backward) eager goes out of place too."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                pos_weight: torch.Tensor | None, reduction: str) -> torch.Tensor:
        ctx.reduction = reduction
        ctx.save_for_backward(input, target, weight, pos_weight)
        return torch.binary_cross_entropy_with_logits(input, target, weight, pos_weight, _REDUCTIONS[reduction])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, target, weight, pos_weight = ctx.saved_tensors
        in_place = not torch.is_grad_enabled()

        def then(tensor: torch.Tensor, name: str, other: Any) -> torch.Tensor:
            return getattr(tensor, name + "_" if in_place else name)(other)

        if pos_weight is not None:
            t = pos_weight.mul(target)
            grad_input = then(then(then(t.add(1), "sub", target), "mul", input.sigmoid()), "sub", t)
        else:
            grad_input = then(input.sigmoid(), "sub", target)
        grad_input = then(grad_input, "mul", grad)
        if weight is not None:
            grad_input = then(grad_input, "mul", weight)
        if ctx.reduction == "mean":
            grad_input.div_(input.numel())
        return grad_input, None, None, None, None


def binary_cross_entropy_with_logits(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                                     size_average: Any = None, reduce: Any = None, reduction: str = "mean",
                                     pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    eager = (size_average is None and reduce is None and reduction in _REDUCTIONS
             and _plain(("binary_cross_entropy_with_logits",), input, target)
             and not any(t is not None and t.requires_grad for t in (target, weight, pos_weight))
             and all(t is None or (t.is_floating_point() and t.device == input.device) for t in (weight, pos_weight))
             and target.shape == input.shape)
    if not eager:
        return F.binary_cross_entropy_with_logits(input, target, weight, size_average, reduce, reduction, pos_weight)
    return _apply(_BinaryCrossEntropyWithLogits, ("binary_cross_entropy_with_logits",),
                  (input, target, weight, pos_weight), reduction)


class _EvenlyDistributed(torch.autograd.Function):
    """MaxBackward1, MinBackward1, MedianBackward0, NanmedianBackward0 (a reduction over all elements to
    one of them): evenly_distribute_backward. Its plain path reads whether the result is NaN back
    (typically not), masks the elements equal to it, and fills the gradient shared among them into new
    zeros: `grad.new_zeros(...).masked_fill_(mask, grad / mask.sum())`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        result = reduce(input)
        ctx.save_for_backward(input, result)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        input, result = ctx.saved_tensors
        result.isnan()  # eager reads it back
        mask = input == result
        zeros = grad.new_zeros(input.shape)
        count = mask.sum()
        share = grad / count
        return zeros.masked_fill_(mask, share), None


def _evenly_distributed(reduce: Callable[..., torch.Tensor], ops: tuple[str, ...]) -> Callable[..., Any]:
    """`reduce(input)` over all elements through _EvenlyDistributed; with a dimension, another tensor
    (max(a, b)) or `out`, the function as it is."""

    def call(input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(input, torch.Tensor) or not _plain(ops, input):
            return reduce(input, *args, **kwargs)
        return _apply(_EvenlyDistributed, ops, (input,), reduce)

    return call


class _Take(torch.autograd.Function):
    """TakeBackward0: take_backward, `zeros_like(self).put_(index, grad, accumulate=True)`: in place for
    plain tensors, through `put` (a copy) for subclass-like ones."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, index)
        return torch.take(input, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        input, index = ctx.saved_tensors
        return torch.zeros_like(input).put_(index, grad, True), None


def take(input: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if not isinstance(index, torch.Tensor) or not _plain(("take",), input):
        return torch.take(input, index)
    return _apply(_Take, ("take",), (input,), index)


# the functions, as torch's function modes see them called -> the eager-path version
EAGER_BACKWARDS: dict[Any, Callable[..., Any]] = {
    torch.cumprod: cumprod, torch.Tensor.cumprod: cumprod,
    torch.prod: prod, torch.Tensor.prod: prod,
    F.binary_cross_entropy_with_logits: binary_cross_entropy_with_logits,
    torch.take: take, torch.Tensor.take: take,
    **{f: _evenly_distributed(f, (name,)) for name in ("max", "min", "median", "nanmedian")
       for f in (getattr(torch, name), getattr(torch.Tensor, name))},
}
