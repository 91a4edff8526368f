"""Autocast with another device's op lists, on CPU (and fake CPU) tensors.

The tracer runs the step on fake *CPU* tensors, but what autocast casts, and so what memory it takes,
depends on the op lists of the device that autocast was made for: CUDA runs layer_norm, softmax,
log_softmax and the losses in fp32 and casts matmul-like ops to fp16/bf16; the CPU's lists differ.
`emulated_autocast("cuda")` reproduces CUDA autocast on CPU tensors.

Mechanism: real autocast is a dispatcher key (AutocastCPU for CPU tensors) above autograd, whose
kernels cast the arguments of the listed ops and redispatch with autocast excluded; casts therefore
land in the autograd graph (their saved tensors and backward casts count), composite ops that are not
listed decompose with autocast still on (so e.g. cross_entropy's inner log_softmax and nll_loss meet
their own policies), and a listed op's decomposition is not autocast again. The emulator keeps that
mechanism and swaps only the lists: while an emulator lives, Python kernels registered at AutocastCPU
(`torch.library`) for every op of every list apply the policies of the effective lists, or fall through
to the next key when those lists do not name the op; an emulated region turns CPU autocast on and
makes its lists the effective ones. The details that change memory are reproduced from
aten/src/ATen/autocast_mode.{h,cpp}: the cast cache (a fp32 leaf that requires grad is cast to the low
precision once per region, and the copy stays alive until the outermost region exits), eligibility
(floating, not fp64), promote's widest type, fp32_set_opt_dtype (a missing dtype becomes fp32 rather
than the input being cast), fp32_append_dtype (norm), banned ops, the right-to-left order in which C++
evaluates the casts of one call, and the CUDA branch of the softmax/log_softmax composites (fp16 input
with dtype=fp32 runs `_softmax(x, dim, half_to_float=True)`: no fp32 copy of the input).
torch.autocast(..., enabled=False) inside user code turns CPU autocast off and is respected; so is
torch.utils.checkpoint's recomputation, which re-enters CPU autocast in backward with the state it saved
(during a backward pass the last emulated lists stay effective, and the cast cache is dropped whenever
torch.clear_autocast_cache() is, which the emulator wraps while it lives).

Outside emulated regions and backward passes the kernels follow the CPU's own lists, which the tests
check against torch.autocast("cpu"): a plain CPU autocast elsewhere in the process is unchanged even
while an emulator lives. `close()` (or garbage collection) unregisters everything. Emulators work on CPU
tensors (device_type "cpu"), fake or real; on real CPU tensors the half_to_float softmax branch is not
taken (the CPU kernel refuses it).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.library import Library

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AUTOCAST_LISTS", "EmulatedAutocast", "OpLists", "autocast_policy", "cast_arguments", "emulated_autocast", "without_autocast"]


@dataclass(frozen=True)
class OpLists:
    """One device's autocast op lists. Names are "op" (default overload) or "op.overload"."""

    lower_precision: frozenset[str]  # CastPolicy::lower_precision_fp: inputs to the autocast dtype
    fp32: frozenset[str]  # CastPolicy::fp32: inputs to float32
    fp32_set_opt_dtype: frozenset[str]  # run in fp32 by passing dtype=float32 when no dtype was given
    fp32_append_dtype: tuple[tuple[str, str], ...]  # (registered op, op redispatched to with a dtype)
    promote: frozenset[str]  # CastPolicy::promote: inputs to the widest floating input type
    banned: frozenset[str] = frozenset()  # raise, as binary_cross_entropy does under CUDA autocast
    default_dtype: torch.dtype = torch.float16
    # CUDA branch of the softmax/log_softmax composites (aten/src/ATen/native/SoftMax.cpp):
    # `if (input.is_cuda() && input.scalar_type() == Half && dtype == Float) return _softmax(input, dim, true);`
    half_to_float_softmax: bool = False

    def policies(self) -> dict[str, str]:
        table: dict[str, str] = {}
        for policy, names in (
            ("lower_precision", self.lower_precision),
            ("fp32", self.fp32),
            ("fp32_set_opt_dtype", self.fp32_set_opt_dtype),
            ("fp32_append_dtype", {name for name, _ in self.fp32_append_dtype}),
            ("promote", self.promote),
            ("banned", self.banned),
        ):
            for name in names:
                if name in table:
                    raise ValueError(f"{name} is in both {table[name]} and {policy}")
                table[name] = policy
        return table


# --------------------------------------------------------------------------------------------------
# The lists, copied from PyTorch.
#
# CUDA: TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m) in aten/src/ATen/autocast_mode.cpp (pytorch/pytorch
# @ 008ec6b1840c94ff6d0f685bc10fbf585167c673) registers AT_FORALL_LOWER_PRECISION_FP plus
# cudnn_convolution and cudnn_convolution_transpose as lower_precision_fp, AT_FORALL_FP32 as fp32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (norm, fp32_append_dtype),
# AT_FORALL_PROMOTE, and bans binary_cross_entropy. The AT_FORALL_* macros are those of
# aten/src/ATen/autocast_mode.h as shipped with the installed torch 2.13.0
# (site-packages/torch/include/ATen/autocast_mode.h; it adds rms_norm, the upsample ops, vdot and
# linalg_vecdot to the 008ec6b header, and drops the Dimname overloads, which no longer exist).
# tests/test_autocast.py checks these names against the installed build's AutocastCUDA registrations
# and, when the header is there, against its macros.


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


_CUDA_LOWER_PRECISION = _names(
    """
    _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
    linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
    _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
    scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose
    """
)

_CUDA_FP32 = _names(
    """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
    pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm
    frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
    huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
    upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
    upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    """
)

_CUDA_FP32_SET_OPT_DTYPE = _names(
    """
    prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
    linalg_matrix_norm.str_ord sum sum.dim_IntList
    """
)

_CUDA_FP32_APPEND_DTYPE = (
    ("norm.Scalar", "norm.ScalarOpt_dtype"),
    ("norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype"),
)

_CUDA_PROMOTE = _names("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add")

# CPU: TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) in aten/src/ATen/autocast_mode.cpp (pytorch/pytorch
# @ 008ec6b1840c94ff6d0f685bc10fbf585167c673), less prod.dim_Dimname and index_copy.dimname, which
# torch 2.13 no longer has (the test checks the names against the installed AutocastCPU registrations).

_CPU_LOWER_PRECISION = _names(
    """
    conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm addmm
    _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer
    conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention
    _native_multi_head_attention
    """
)

_CPU_FP32 = _names(
    """
    avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile quantile.scalar
    nanquantile nanquantile.scalar stft stft.center cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback
    grid_sampler_3d trace view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr
    ormqr pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d
    reflection_pad2d replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss
    nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss
    huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss.IntList
    ctc_loss.Tensor kl_div multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft
    fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn
    fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank linalg_matrix_rank.tol_tensor
    linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky
    linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv
    linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
    fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward
    linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex
    """
)

_CPU_PROMOTE = _names("stack cat index_copy")

AUTOCAST_LISTS: dict[str, OpLists] = {
    "cuda": OpLists(
        lower_precision=_CUDA_LOWER_PRECISION,
        fp32=_CUDA_FP32,
        fp32_set_opt_dtype=_CUDA_FP32_SET_OPT_DTYPE,
        fp32_append_dtype=_CUDA_FP32_APPEND_DTYPE,
        promote=_CUDA_PROMOTE,
        banned=frozenset({"binary_cross_entropy"}),
        default_dtype=torch.float16,
        half_to_float_softmax=True,
    ),
    "cpu": OpLists(
        lower_precision=_CPU_LOWER_PRECISION,
        fp32=_CPU_FP32,
        fp32_set_opt_dtype=frozenset(),
        fp32_append_dtype=(),
        promote=_CPU_PROMOTE,
        default_dtype=torch.bfloat16,
    ),
}

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


# --------------------------------------------------------------------------------------------------
# cached_cast and friends (aten/src/ATen/autocast_mode.{h,cpp}), for CPU tensors

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)

# Source tensor id -> (weak reference to the source, its cast). Cleared with the autocast cache.
_cast_cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _eligible(t: Any) -> bool:
    """is_eligible(arg, CPU): a defined floating CPU tensor that is not fp64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cpu"


def _cached_cast(to: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    if not _eligible(t) or t.dtype == to:
        return t
    can_try_cache = (
        to == torch.get_autocast_dtype("cpu")
        and t.dtype == torch.float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
        and not torch._C._is_cached_tensor(t)
    )
    if not can_try_cache:
        return t.to(to)
    hit = _cast_cache.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    cast = t.to(to)
    _cast_cache[id(t)] = (weakref.ref(t), cast)
    return cast


def cast_arguments(to: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Cast every eligible Tensor, Tensor? and Tensor[] argument; C++ evaluates the casts of one call
    right to left (the order of the `_to_copy` ops), and a Tensor[] front to back."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _cached_cast(to, value)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return type(value)(_cached_cast(to, v) for v in value)
        return value  # scalars, None, and Tensor?[] (index_put's indices: C++ does not cast them)

    new_kwargs = {k: cast(v) for k, v in reversed(kwargs.items())}
    new_args = [cast(v) for v in reversed(args)][::-1]
    return tuple(new_args), {k: new_kwargs[k] for k in kwargs}


def _promote_type(args: tuple, kwargs: dict) -> torch.dtype:
    """promote_type(): the widest eligible floating input; fp64 inputs are ignored."""
    lower = torch.get_autocast_dtype("cpu")
    current = lower
    for value in (*args, *kwargs.values()):
        tensors = value if isinstance(value, (list, tuple)) else (value,)
        for t in tensors:
            if not _eligible(t):
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif current == lower and t.dtype == lower:
                current = lower
            else:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _no_data(t: torch.Tensor) -> bool:
    return is_fake(t) or t.is_meta


def _dtype_slot(op: torch._ops.OpOverload) -> tuple[int, bool]:
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dtype":
            return i, arg.kwarg_only
    raise ValueError(f"{op} has no dtype argument")


def _make_kernel(op: torch._ops.OpOverload, policy: str, lists: OpLists, redispatch: Any = None) -> Callable:
    if policy == "banned":

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_BANNED_MESSAGE)

        return banned

    if policy in ("lower_precision", "fp32", "promote"):

        def cast_policy(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                if policy == "lower_precision":
                    to = torch.get_autocast_dtype("cpu")
                elif policy == "fp32":
                    to = torch.float32
                else:
                    to = _promote_type(args, kwargs)
                args, kwargs = cast_arguments(to, args, kwargs)
                return op(*args, **kwargs)

        return cast_policy

    if policy == "fp32_set_opt_dtype":
        slot, kwarg_only = _dtype_slot(op)
        name = op._schema.name.split("::")[-1]
        half_to_float = lists.half_to_float_softmax and name in ("softmax", "log_softmax")
        inner = torch.ops.aten._softmax.default if name == "softmax" else torch.ops.aten._log_softmax.default

        def set_opt_dtype(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                if not _eligible(args[0]):
                    return op(*args, **kwargs)  # ineligible: unaltered, no dtype set
                if not kwarg_only and len(args) > slot:
                    dtype = args[slot]
                    if dtype is None:
                        args = (*args[:slot], torch.float32, *args[slot + 1 :])
                else:
                    dtype = kwargs.get("dtype")
                    if dtype is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                dtype = dtype if dtype is not None else torch.float32
                if half_to_float and args[0].dtype == torch.float16 and dtype == torch.float32 and _no_data(args[0]):
                    # the composite's is_cuda() branch (real CPU kernels refuse half_to_float, so real
                    # CPU tensors take the CPU branch: a transient fp32 copy of the input)
                    return inner(args[0], args[1], True)
                return op(*args, **kwargs)

        return set_opt_dtype

    if policy == "fp32_append_dtype":
        names = [a.name for a in op._schema.arguments]
        defaults = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}

        def append_dtype(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
                bound = {**defaults, **dict(zip(names, args)), **kwargs}
                self = bound["self"]
                out_type = torch.float32 if _eligible(self) else self.dtype
                full = [bound[n] for n in names]
                return redispatch(*full, dtype=out_type)

        return append_dtype

    raise ValueError(f"unknown cast policy {policy!r}")


def _overload(name: str) -> torch._ops.OpOverload | None:
    op_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op_name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


# --------------------------------------------------------------------------------------------------
# The registration: Python kernels at AutocastCPU for every op of every list, while an emulator lives.
#
# Which lists a kernel follows (`_effective_lists`): the emulated lists inside an emulated region, and
# during a backward pass that runs while the emulator lives (checkpoint recomputation re-enters CPU
# autocast there); otherwise the CPU's own lists, so that a plain torch.autocast("cpu") elsewhere in the
# process keeps its native behaviour even while an emulator is alive. An op that the effective lists do
# not name falls through to the next dispatch key, as an unlisted op does natively.

_AFTER_AUTOCAST_CPU = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutocastCPU)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.regions: list[str] = []  # lists of the emulated regions open on this thread
        self.last: tuple[int, str] | None = None  # (registration, lists) of its last emulated region


_thread = _ThreadState()


def _effective_lists() -> str:
    if _thread.regions:
        return _thread.regions[-1]
    last = _thread.last
    if last is not None and last[0] == _REGISTRY.generation and torch._C._current_graph_task_id() != -1:
        return last[1]
    return "cpu"


class _Registry:
    """The kernels are registered while any emulator holds them. They are never unregistered while one
    of them runs (an emulator may be garbage-collected inside one): a release then waits for the next
    region boundary or `close()` (meanwhile, outside emulated regions, the kernels act natively)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.holders: set[int] = set()
        self.library: Library | None = None
        self.generation = 0
        self.running = 0  # kernels executing now, all threads
        self.saved_clear_cache: Callable[[], None] | None = None

    @property
    def registered(self) -> bool:
        return self.library is not None

    def use(self, holder: int) -> None:
        with self.lock:
            self.holders.add(holder)
            if self.library is None:
                self._register()

    def release(self, holder: int) -> None:
        with self.lock:
            self.holders.discard(holder)
            self.sweep()

    def sweep(self) -> None:
        """Unregister if nothing holds the kernels and none is running."""
        with self.lock:
            if not self.holders and not self.running and self.library is not None:
                self._unregister()

    def kernel_started(self) -> None:
        with self.lock:
            self.running += 1

    def kernel_finished(self) -> None:
        with self.lock:
            self.running -= 1

    def _register(self) -> None:
        kernels: dict[str, dict[str, Callable]] = {}  # op name -> lists name -> policy kernel
        for lists_name, lists in AUTOCAST_LISTS.items():
            redispatch = dict(lists.fp32_append_dtype)
            for name, policy in lists.policies().items():
                op = _overload(name)
                if op is not None:
                    target = _overload(redispatch[name]) if policy == "fp32_append_dtype" else None
                    kernels.setdefault(name, {})[lists_name] = _make_kernel(op, policy, lists, target)
        library = Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name, by_lists in kernels.items():
                library.impl(name, _dispatching_kernel(_overload(name), by_lists), "AutocastCPU", with_keyset=True)
        self.library = library
        self.generation += 1
        # torch.autocast clears the autocast cache when the outermost region exits (and so does
        # checkpoint's recomputation): clear the emulator's cache with it.
        saved = self.saved_clear_cache = torch.clear_autocast_cache

        def clear_autocast_cache() -> None:
            _cast_cache.clear()
            saved()

        torch.clear_autocast_cache = clear_autocast_cache

    def _unregister(self) -> None:
        self.library._destroy()
        self.library = None
        torch.clear_autocast_cache = self.saved_clear_cache
        self.saved_clear_cache = None
        _cast_cache.clear()


def _dispatching_kernel(op: torch._ops.OpOverload, by_lists: dict[str, Callable]) -> Callable:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        _REGISTRY.kernel_started()
        try:
            policy = by_lists.get(_effective_lists())
            if policy is None:  # not on the effective lists: fall through, autocast still on
                return op.redispatch(keyset & _AFTER_AUTOCAST_CPU, *args, **kwargs)
            return policy(*args, **kwargs)
        finally:
            _REGISTRY.kernel_finished()

    return kernel


_REGISTRY = _Registry()


# --------------------------------------------------------------------------------------------------
# The public face


class _Region:
    """One autocast region: like torch.autocast("cpu", dtype), with the emulated lists."""

    def __init__(self, emulator: EmulatedAutocast, dtype: torch.dtype, enabled: bool, cache_enabled: bool) -> None:
        self.emulator, self.dtype, self.enabled, self.cache_enabled = emulator, dtype, enabled, cache_enabled

    def __enter__(self) -> Self:
        self.emulator._hold()
        self.prev = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled(),
        )
        torch.set_autocast_enabled("cpu", self.enabled)
        torch.set_autocast_dtype("cpu", self.dtype)
        torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(self.cache_enabled)
        _thread.regions.append(self.emulator.lists)
        _thread.last = (_REGISTRY.generation, self.emulator.lists)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _REGISTRY.sweep()
        _thread.regions.pop()
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()  # the emulator's cache too (see _Registry)
            _cast_cache.clear()
        enabled, dtype, cache_enabled = self.prev
        torch.set_autocast_enabled("cpu", enabled)
        torch.set_autocast_dtype("cpu", dtype)
        torch.set_autocast_cache_enabled(cache_enabled)


class EmulatedAutocast:
    """`emulator(device_type, dtype)` is a context manager like `torch.autocast(device_type, dtype)`
    that follows `AUTOCAST_LISTS[lists]`. Its kernels stay registered from the first region until
    `close()` (or garbage collection), so that checkpoint recomputation in backward is autocast alike."""

    def __init__(self, lists: str) -> None:
        if lists not in AUTOCAST_LISTS:
            raise ValueError(f"unknown autocast lists {lists!r}; expected one of: {', '.join(AUTOCAST_LISTS)}")
        self.lists = lists
        self._key = id(self)
        self._finalizer: weakref.finalize | None = None

    def __call__(
        self,
        device_type: str = "cpu",
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
    ) -> _Region:
        if device_type != "cpu":
            raise ValueError(f"emulated autocast runs on CPU tensors (device_type 'cpu'), got {device_type!r}")
        return _Region(self, dtype or AUTOCAST_LISTS[self.lists].default_dtype, enabled, cache_enabled)

    def _hold(self) -> None:
        _REGISTRY.sweep()
        if self._finalizer is None or not self._finalizer.alive:
            self._finalizer = weakref.finalize(self, _REGISTRY.release, self._key)
        _REGISTRY.use(self._key)

    def close(self) -> None:
        """Unregister the kernels (when no other emulator holds them): CPU autocast is all native again."""
        if self._finalizer is not None:
            self._finalizer()
        _REGISTRY.sweep()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def emulated_autocast(lists: str) -> EmulatedAutocast:
    """A replacement for torch.autocast, `(device_type, dtype) -> context manager`, that applies the
    autocast op lists of `lists` ("cuda" or "cpu") to CPU tensors, fake or real."""
    return EmulatedAutocast(lists)


def autocast_policy(name: str) -> str | None:
    """The policy CPU autocast applies to the op `name` ("op" or "op.overload") here and now: under the
    effective lists (an emulated region's, or the CPU's own) while CPU autocast is on; None when it is
    off or the lists do not name the op."""
    if not torch.is_autocast_enabled("cpu"):
        return None
    return AUTOCAST_LISTS[_effective_lists()].policies().get(name)


def without_autocast() -> torch._C._ExcludeDispatchKeyGuard:
    """A region that autocast's kernels do not see, as the ops an autocast kernel redispatches to."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)
