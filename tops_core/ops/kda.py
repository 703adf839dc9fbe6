"""kda: Kimi Delta Attention (docs/ops.md "kda").

For each sequence and value head, with ``S_0 = initial_state`` (zeros if None)::

    S_t' = diag(exp(g_t)) S_{t-1}                          # decay each key row
    S_t  = S_t' + beta_t * k_t^T (v_t - k_t S_t')           # delta rule
    o_t  = scale * q_t S_t

with ``q, k`` L2-normalised over ``K`` first when ``use_qk_l2norm``. Value head ``j`` of ``HV`` reads
query/key head ``j // (HV // H)`` (grouped value heads). ``g`` is the log decay itself, or with
``use_gate`` the raw input of ``gate`` below; ``beta`` is the write strength, or with
``use_beta_sigmoid`` its logits (``beta_activation``). Implementations follow ``Forward`` and
``Backward`` below; the arguments arrive validated, as for simple_gla.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from tops_core.ops import delta_sequence, validation
from tops_core.ops.base import Explanation, OpContract, Prepared, nan_where, state_dtype
from tops_core.ops.validation import is_concrete
from tops_core.policy import ForceRequest
from tops_core.signatures import KDA as KDA_SIGNATURE

Array = jax.Array

L2NORM_EPSILON = 1e-6
"""``use_qk_l2norm``'s epsilon, flash-linear-attention's: ``x / sqrt(sum over K of x^2 + L2NORM_EPSILON)``."""


def gate(g: Array, A_log: Array | None, dt_bias: Array | None, lower_bound: float | None) -> Array:
    """The log decay ``use_gate`` computes from the raw gate ``g`` (flash-linear-attention's KDA gate).

    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (without ``A_log``:
    ``lower_bound * sigmoid(g + dt_bias)``), in float32 (float64 for float64 inputs). Elementwise:
    ``A_log`` and ``dt_bias`` come shaped to broadcast against ``g`` (per head ``[HV, 1]`` and
    ``[HV, K]`` for a ``[..., HV, K]`` gate), so kernels apply it to the blocks they hold.
    """
    dtype = state_dtype(g.dtype)
    x = g.astype(dtype)
    if dt_bias is not None:
        x = x + dt_bias.astype(dtype)
    if lower_bound is None:
        return -jnp.exp(A_log.astype(dtype)) * jax.nn.softplus(x)
    if A_log is not None:
        x = jnp.exp(A_log.astype(dtype)) * x
    return lower_bound * jax.nn.sigmoid(x)


def beta_activation(beta: Array, allow_neg_eigval: bool) -> Array:
    """The write strength ``use_beta_sigmoid`` computes from logits: ``sigmoid(beta)``, twice that with
    ``allow_neg_eigval`` (a strength in ``(0, 2)``: the delta rule's eigenvalue ``1 - beta`` may be negative)."""
    strength = jax.nn.sigmoid(beta.astype(state_dtype(beta.dtype)))
    return 2 * strength if allow_neg_eigval else strength


@dataclasses.dataclass(frozen=True)
class Activations:
    """The static half of a call's gate and beta: what turns the ``g`` and ``beta`` it passes into the log
    decay and write strength the recurrence runs on. Hashable, for a jitted function's static argument or
    a kernel's closure; kernels apply ``decay`` and ``strength`` to the blocks they hold."""

    use_gate: bool = False
    lower_bound: float | None = None  # the gate's, with use_gate only
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    promised_lower_bound: float | None = None  # without use_gate: the bound g is promised (and checked) to respect

    @classmethod
    def of(
        cls, use_gate: bool, lower_bound: float | None, use_beta_sigmoid: bool, allow_neg_eigval: bool, *,
        keep_promise: bool = False,
    ) -> Activations:
        """Without use_gate the bound only promises where g lies, and ``decay`` uses g exactly either way. By
        default the promise is dropped, so the call shares the program of the call without it;
        ``keep_promise`` keeps it (``decay_lower_bound``) for a kernel that computes faster with it."""
        promise = lower_bound if keep_promise and not use_gate else None
        return cls(use_gate, lower_bound if use_gate else None, use_beta_sigmoid, allow_neg_eigval, promise)

    @property
    def decay_lower_bound(self) -> float | None:
        """A static bound ``L < 0`` that every log decay ``decay`` returns respects (``L <= decay <= 0``), or None:
        the gate's ``lower_bound`` with use_gate, else the kept promise about g."""
        return self.lower_bound if self.use_gate else self.promised_lower_bound

    def decay(self, g: Array, A_log: Array | None, dt_bias: Array | None) -> Array:
        """``gate(g, A_log, dt_bias, lower_bound)`` with ``use_gate``, else ``g`` as given."""
        return gate(g, A_log, dt_bias, self.lower_bound) if self.use_gate else g

    def strength(self, beta: Array) -> Array:
        """``beta_activation(beta, allow_neg_eigval)`` with ``use_beta_sigmoid``, else ``beta`` as given."""
        return beta_activation(beta, self.allow_neg_eigval) if self.use_beta_sigmoid else beta

    def applied(self, g: Array, beta: Array, A_log: Array | None, dt_bias: Array | None) -> tuple[Array, Array]:
        """``(log decay, strength)`` of whole ``g`` ``[..., HV, K]`` and ``beta``: ``A_log`` ``[HV]`` and ``dt_bias``
        ``[HV * K]`` as a call passes them, shaped per value head for ``decay``."""
        HV, K = g.shape[-2:]
        per_head = None if A_log is None else A_log[:, None]
        per_key = None if dt_bias is None else dt_bias.reshape(HV, K)
        return self.decay(g, per_head, per_key), self.strength(beta)


def l2norm(x: Array) -> Array:
    """The norm ``use_qk_l2norm`` divides ``x`` by, over its last axis."""
    return jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPSILON)


def token_inputs(q, k, g, beta, A_log, dt_bias, *, activations: Activations, use_qk_l2norm: bool, dtype) -> tuple[Array, ...]:
    """``(q, k, log decay, strength)`` in ``dtype`` as a token-by-token recurrence runs on them: the gate and beta
    activated, ``q`` and ``k`` normalised with ``use_qk_l2norm`` (not yet scaled, nor repeated to grouped value heads)."""
    log_decay, strength = activations.applied(g, beta, A_log, dt_bias)
    q, k = q.astype(dtype), k.astype(dtype)
    if use_qk_l2norm:
        q, k = q / l2norm(q), k / l2norm(k)
    return q, k, log_decay.astype(dtype), strength.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAGrads:
    """Gradients of kda; ``dinitial_state``, ``dA_log`` and ``ddt_bias`` are None exactly when their input was not given.

    ``dg`` and ``dbeta`` are those of the arguments as given: of the raw gate with ``use_gate``, of the
    logits with ``use_beta_sigmoid``."""

    dq: Array
    dk: Array
    dv: Array
    dg: Array
    dbeta: Array
    dinitial_state: Array | None = None
    dA_log: Array | None = None
    ddt_bias: Array | None = None


class Forward(Protocol):
    def __call__(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        *,
        scale: float,
        initial_state: Array | None,
        output_final_state: bool,
        cu_seqlens: Array | None,
        use_qk_l2norm: bool,
        use_gate: bool,
        A_log: Array | None,
        dt_bias: Array | None,
        lower_bound: float | None,
        use_beta_sigmoid: bool,
        allow_neg_eigval: bool,
        config: Any,
    ) -> tuple[Array, Array | None]:
        """Return ``o`` ``[B, T, HV, V]`` (dtype of ``v``) and the final state ``[N, HV, K, V]`` or None."""


class Backward(Protocol):
    def __call__(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        do: Array,
        *,
        scale: float,
        initial_state: Array | None,
        dht: Array | None,
        cu_seqlens: Array | None,
        use_qk_l2norm: bool,
        use_gate: bool,
        A_log: Array | None,
        dt_bias: Array | None,
        lower_bound: float | None,
        use_beta_sigmoid: bool,
        allow_neg_eigval: bool,
        config: Any,
    ) -> KDAGrads:
        """Return the exact VJP for cotangents ``do`` and ``dht`` (None: no final-state cotangent)."""


_OPTION_NAMES = ("use_qk_l2norm", "use_gate", "lower_bound", "use_beta_sigmoid", "allow_neg_eigval")


class KDA(OpContract, signature=KDA_SIGNATURE):
    differentiable = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    grads_type = KDAGrads
    dims = {
        "q": "b t h k", "k": "b t h k", "v": "b t h v", "g": "b t h k", "beta": "b t h",
        "initial_state": "n h k v", "cu_seqlens": "c", "A_log": "h", "dt_bias": "h",
    }
    sequence_parallel = delta_sequence

    def forward(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        scale: float | None = None,
        initial_state: Array | None = None,
        output_final_state: bool = False,
        cu_seqlens: Array | None = None,
        use_qk_l2norm: bool = False,
        use_gate: bool = False,
        A_log: Array | None = None,
        dt_bias: Array | None = None,
        lower_bound: float | None = None,
        use_beta_sigmoid: bool = False,
        allow_neg_eigval: bool = False,
        ssm_state_indices: Array | None = None,
        *,
        implementation: ForceRequest = None,
    ) -> tuple[Array, Array | None]:
        """Compute ``(o, final_state)``; differentiable with ``jax.grad``, and works under ``jit``/``vmap``.

        With ``ssm_state_indices``, ``initial_state`` is a state pool and the final state is the updated pool
        (``tops_core.ops.pool``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, policy.interpret,
            ssm_state_indices=ssm_state_indices, **_gate_and_beta(use_gate, A_log, dt_bias, lower_bound, use_beta_sigmoid, allow_neg_eigval),
        )
        return self._forward(prepared, policy)

    def backward(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        do: Array,
        scale: float | None = None,
        initial_state: Array | None = None,
        dht: Array | None = None,
        cu_seqlens: Array | None = None,
        use_qk_l2norm: bool = False,
        use_gate: bool = False,
        A_log: Array | None = None,
        dt_bias: Array | None = None,
        lower_bound: float | None = None,
        use_beta_sigmoid: bool = False,
        allow_neg_eigval: bool = False,
        ssm_state_indices: Array | None = None,
        *,
        implementation: ForceRequest = None,
    ) -> KDAGrads:
        """The explicit VJP: gradients for cotangents ``do`` (and ``dht``, the final state's: the pool's with ``ssm_state_indices``)."""
        policy = self.policy(implementation)
        prepared = self.prepare(
            q, k, v, g, beta, scale, initial_state, dht is not None, cu_seqlens, use_qk_l2norm, policy.interpret,
            ssm_state_indices=ssm_state_indices, **_gate_and_beta(use_gate, A_log, dt_bias, lower_bound, use_beta_sigmoid, allow_neg_eigval),
        )
        do, dht = self.check_cotangents(prepared, do, dht)
        return self._backward(prepared, policy, do, dht)

    def explain(
        self,
        q: Array,
        k: Array,
        v: Array,
        g: Array,
        beta: Array,
        scale: float | None = None,
        initial_state: Array | None = None,
        output_final_state: bool = False,
        cu_seqlens: Array | None = None,
        use_qk_l2norm: bool = False,
        use_gate: bool = False,
        A_log: Array | None = None,
        dt_bias: Array | None = None,
        lower_bound: float | None = None,
        use_beta_sigmoid: bool = False,
        allow_neg_eigval: bool = False,
        ssm_state_indices: Array | None = None,
        *,
        implementation: ForceRequest = None,
    ) -> Explanation:
        """Which implementations the forward and backward of this call would use, and why."""
        policy = self.policy(implementation)
        prepared = self.prepare(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, policy.interpret,
            ssm_state_indices=ssm_state_indices, **_gate_and_beta(use_gate, A_log, dt_bias, lower_bound, use_beta_sigmoid, allow_neg_eigval),
        )
        return self._explain(prepared, policy)

    def prepare(
        self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, interpret, *,
        use_gate=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid=False, allow_neg_eigval=False,
        ssm_state_indices=None,
    ) -> Prepared:
        """Validate a call (docs/ops.md "Invalid input") and derive its call spec."""
        q, k, v, (B, T, H, K, V) = validation.qkv(q, k, v, initial_state_given=initial_state is not None, grouped_values=True)
        HV = v.shape[2]
        floats = state_dtype(q.dtype)  # the dtype Python numbers and lists become
        g = validation.shape("g", validation.real_array("g", g, floats), (B, T, HV, K), "[B, T, HV, K]")
        beta = validation.shape("beta", validation.real_array("beta", beta, floats), (B, T, HV), "[B, T, HV]")
        cu_seqlens, N = validation.cu_seqlens(cu_seqlens, B, T)
        initial_state = validation.real_array("initial_state", initial_state, floats, required=False)
        ssm_state_indices = validation.state_indices(ssm_state_indices, initial_state, N, floats)
        if initial_state is not None:
            validation.state_shape(initial_state, ssm_state_indices, N, (HV, K, V), "HV, K, V")
        flags = {name: validation.flag(name, value) for name, value in (
            ("output_final_state", output_final_state), ("use_qk_l2norm", use_qk_l2norm), ("use_gate", use_gate),
            ("use_beta_sigmoid", use_beta_sigmoid), ("allow_neg_eigval", allow_neg_eigval),
        )}
        lower_bound = validation.negative_number("lower_bound", lower_bound)
        A_log, dt_bias = _gate_parameters(A_log, dt_bias, flags["use_gate"], lower_bound, HV, K, floats)
        if flags["allow_neg_eigval"] and not flags["use_beta_sigmoid"]:
            raise ValueError(
                "allow_neg_eigval=True scales sigmoid(beta) to (0, 2) and needs use_beta_sigmoid=True "
                "(beta given as logits); a beta given as is already says what it is"
            )
        if lower_bound is not None and not flags["use_gate"] and is_concrete(g):
            _check_bounded(g, lower_bound)
        options = (("scale", validation.scale(scale, K)), *flags.items(), ("lower_bound", lower_bound))
        arrays = dict(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
            ssm_state_indices=ssm_state_indices,
        )
        return self.make_prepared(arrays, options, N, {}, interpret)

    def checked_when_traced(self, arrays, options) -> tuple[str, ...]:
        bounded = options.get("lower_bound") is not None and not options.get("use_gate")
        return super().checked_when_traced(arrays, options) + (("g",) if bounded else ())

    def valid_in_program(self, prepared: Prepared) -> tuple[Array, Prepared]:
        valid, prepared = super().valid_in_program(prepared)
        if "g" in prepared.checked_in_program:
            valid = valid & _bounded(prepared.arrays["g"], prepared.option("lower_bound"))
        return valid, prepared

    def _arguments(self, prepared: Prepared, config: Any) -> dict[str, Any]:
        a = prepared.arrays
        return dict(
            scale=prepared.option("scale"), initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"],
            A_log=a["A_log"], dt_bias=a["dt_bias"], config=config, **{name: prepared.option(name) for name in _OPTION_NAMES},
        )

    def poisoned(self, arrays, bad):
        """``beta`` (``[B, T, HV]``): a NaN write strength makes the state NaN, whatever its activation."""
        return {**arrays, "beta": nan_where(bad, arrays["beta"])}

    def counted_flops_per_token(self, key_dim: int, value_dim: int, chunk_size: int) -> float:
        """``6KV`` (queries and keys against the state, the state update), ``4C(K+V)`` (``Aqk``, ``Akk``, the inverse
        and ``Aqk`` against the writes) and ``2C^2/3`` (the blocked triangular inverse)."""
        return 6 * key_dim * value_dim + 4 * chunk_size * (key_dim + value_dim) + 2 * chunk_size * chunk_size / 3

    def call_forward(self, fn: Forward, prepared: Prepared, config: Any):
        a = prepared.arrays
        return fn(
            a["q"], a["k"], a["v"], a["g"], a["beta"], output_final_state=prepared.option("output_final_state"),
            **self._arguments(prepared, config),
        )

    def call_backward(self, fn: Backward, prepared: Prepared, do: Array, dht: Array | None, config: Any):
        a = prepared.arrays
        return fn(a["q"], a["k"], a["v"], a["g"], a["beta"], do, dht=dht, **self._arguments(prepared, config))


def _gate_and_beta(use_gate, A_log, dt_bias, lower_bound, use_beta_sigmoid, allow_neg_eigval) -> dict[str, Any]:
    return dict(use_gate=use_gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_beta_sigmoid=use_beta_sigmoid, allow_neg_eigval=allow_neg_eigval)


def _gate_parameters(A_log, dt_bias, use_gate: bool, lower_bound: float | None, HV: int, K: int, floats):
    """``A_log`` ``[HV]`` and ``dt_bias`` ``[HV * K]``, validated against ``use_gate`` (they mean nothing without it)."""
    A_log = validation.real_array("A_log", A_log, floats, required=False)
    dt_bias = validation.real_array("dt_bias", dt_bias, floats, required=False)
    if not use_gate:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
            if value is not None:
                raise ValueError(f"{name} is a parameter of the gate computed in the op: pass use_gate=True (g is then the raw gate), or leave {name} out")
        return None, None
    if A_log is None and lower_bound is None:
        raise ValueError("use_gate=True needs A_log [HV] (the gate -exp(A_log) * softplus(g + dt_bias)); only the bounded gate (lower_bound) may go without it")
    if A_log is not None:
        validation.shape("A_log", A_log, (HV,), "[HV], one per value head")
    if dt_bias is not None:
        validation.shape("dt_bias", dt_bias, (HV * K,), f"[HV * K] = [{HV} * {K}], one per value head and key")
    return A_log, dt_bias


def _bounded(g: Array, lower_bound: float) -> Array:
    return jnp.all((g >= lower_bound) & (g <= 0))


def _check_bounded(g: Array, lower_bound: float) -> None:
    if not bool(_bounded(g, lower_bound)):
        low, high = float(jnp.min(g)), float(jnp.max(g))
        raise ValueError(
            f"g must lie in [lower_bound, 0] = [{lower_bound}, 0] when lower_bound is given without use_gate "
            f"(it promises the kernels that bound), got values in [{low}, {high}]"
        )
