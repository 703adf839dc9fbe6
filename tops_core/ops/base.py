"""The machinery every op shares: selection, differentiation and contract checks.

An op contract (one module per op) validates a call into a ``Prepared`` call and knows how to
call an implementation's forward and backward; this base turns that into a ``jax.custom_vjp``
function whose forward and backward implementations are selected separately. The residuals
are the original inputs: a backward recomputes what it needs, so any backward pairs with any
forward. Where one implementation runs both (``Implementation.residuals``), its forward hands its
backward what it would otherwise recompute (``Residuals``).

Where a call runs: the device of its inputs when none is traced (an eager call). A traced call
(under ``jit``, ``grad``, ``vmap``, or lowered ahead of time from abstract inputs, perhaps for
another platform) runs wherever its program is lowered for, so it is decided for every platform
and the choice is left to the lowering (``tops_core.lowering``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tops_core import environment, parallel
from tops_core.callspec import PLATFORMS, CallSpec
from tops_core.dispatch import Decision, NoImplementationError, pairing_note, select
from tops_core.lowering import Choice, same_choice, stage_per_platform
from tops_core.ops import pool, validation
from tops_core.ops.validation import is_concrete
from tops_core.partitioning import Plan, SequenceShards, Split, partitioned
from tops_core.policy import ForceRequest, Policy, current_policy
from tops_core.registry import default_registry
from tops_core.signatures import Signature
from tops_core.tpu.generations import generation_of


class ContractError(RuntimeError):
    """An implementation returned results that break the op contract (shape, dtype, missing gradient)."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated call: array inputs by name (``None`` when absent), static options, and the call spec.

    ``checked_in_program``: the rules on values that could not be checked when the call was
    validated, because the values were traced (``"cu_seqlens"``, kda's ``"lower_bound"``): they are
    checked inside the program instead (``OpContract.valid_in_program``). ``platform_known``:
    ``spec.platform`` is the inputs' device (an eager call). Otherwise it is the host's, and the
    call is decided per platform at lowering. ``rules_kept``: for a pool call whose traced values were
    checked in the program, whether they keep the rules (a traced boolean; ``OpContract._checked``).
    """

    arrays: Mapping[str, Any]
    options: tuple[tuple[str, Any], ...]
    spec: CallSpec
    checked_in_program: tuple[str, ...] = ()
    platform_known: bool = True
    rules_kept: Any = None

    def option(self, name: str) -> Any:
        return dict(self.options)[name]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The forward and backward decisions for one call; ``str()`` gives the full trace.

    ``elsewhere``: for a traced call, the same for every other platform it may be lowered for
    (an ``Explanation``, or the error when no forward supports it there). ``call_notes``: lines on what
    the core does around the implementations (a state pool's rows).
    """

    forward: Decision
    backward: Decision | None
    backward_error: str | None = None
    elsewhere: tuple[tuple[str, Explanation | str], ...] = ()
    call_notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.backward is None:
            text = f"{self.forward.explain()}\n{self.backward_error}"
        else:
            pairing = pairing_note(self.forward, self.backward)
            text = "\n".join([self.forward.explain(), self.backward.explain()] + ([pairing] if pairing else []))
        text = "\n".join([*self.call_notes, text])
        if not self.elsewhere:
            return text
        lines = [text, "", "The inputs are traced: the program runs where it is lowered for, so every platform is decided and the lowering keeps its own choice."]
        for platform, explanation in self.elsewhere:
            lines += ["", f"if lowered for {platform}:", str(explanation)]
        lines += ["", "chosen at lowering (forward / backward):"]
        for platform, explanation in ((self.forward.spec.platform, self), *self.elsewhere):
            lines.append(f"  {platform}: {_winners(explanation)}")
        return "\n".join(lines)


def _winners(explanation: Explanation | str) -> str:
    if isinstance(explanation, str):
        return "no implementation (lowering for it raises NoImplementationError)"
    backward = explanation.backward.implementation.name if explanation.backward else "no backward"
    return f"{explanation.forward.implementation.name} / {backward}"


def _concrete_device(arrays: Sequence[Any]) -> jax.Device | None:
    """The inputs' device when none is traced (an eager call); None otherwise.

    A concrete array beside traced ones is a constant of a program that runs wherever it is
    lowered for, so it says nothing about the device.
    """
    arrays = [x for x in arrays if isinstance(x, jax.Array)]
    if not arrays or not all(is_concrete(x) for x in arrays):
        return None
    return next(iter(arrays[0].devices()))


def concrete_platform(arrays: list[Any]) -> str | None:
    """The platform of the inputs' device when none is traced (an eager call); None otherwise."""
    device = _concrete_device(arrays)
    return None if device is None else _spec_platform(device.platform)


def host_platform() -> str:
    """JAX's default device's platform: where a call with no concrete input runs unless lowered elsewhere."""
    device = jax.config.jax_default_device
    return _spec_platform(device.platform if isinstance(device, jax.Device) else jax.default_backend())


def target_chip(arrays: Sequence[Any] = ()) -> str | None:
    """The TPU generation a call is lowered for when it is lowered for a TPU, as far as it is known:
    that of its inputs' device in an eager call, else that of the device of the mesh in context
    (``jax.set_mesh``, ``jax.sharding.use_mesh``), else that of JAX's default device; None when that
    device is not a TPU of a known generation (a traced call on a CPU host, lowered for a TPU later)."""
    device = _concrete_device(arrays) or jax.sharding.get_abstract_mesh().abstract_device or jax.config.jax_default_device
    if not isinstance(device, (jax.Device, jax.sharding.AbstractDevice)):
        device = jax.devices()[0]
    return generation_of(device.device_kind) if device.platform == "tpu" else None


def platform_of(arrays: list[Any]) -> str:
    """The platform a call runs on: its inputs' device in an eager call, else JAX's default."""
    return concrete_platform(arrays) or host_platform()


def _spec_platform(platform: str) -> str:
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def spec_dtype(x: jax.Array) -> str:
    return jnp.dtype(x.dtype).name


def state_dtype(input_dtype: Any) -> jnp.dtype:
    """Final states and other accumulators: float32, or float64 for float64 inputs."""
    return jnp.dtype(jnp.float64) if jnp.dtype(input_dtype) == jnp.float64 else jnp.dtype(jnp.float32)


class OpContract:
    """Base of every op contract; subclasses define the public ``forward``/``backward``/``explain``.

    A subclass names its op's signature (``class SimpleGLA(OpContract, signature=SIMPLE_GLA)``),
    which gives it ``name``, ``features`` (optional inputs and options a call spec can name) and
    ``variable_ndims`` (inputs whose rank may vary); it declares ``differentiable`` (array inputs
    that get a gradient, field ``d<name>`` of ``grads_type``).
    """

    signature: ClassVar[Signature]
    name: ClassVar[str]
    features: ClassVar[frozenset[str]]
    variable_ndims: ClassVar[frozenset[str]]
    differentiable: ClassVar[tuple[str, ...]]
    grads_type: ClassVar[type]

    def __init_subclass__(cls, signature: Signature | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if signature is not None:
            cls.signature = signature
            cls.name, cls.features, cls.variable_ndims = signature.name, signature.features, signature.variable_ndims

    # -- what each op defines --------------------------------------------------------------

    def call_forward(self, fn: Any, prepared: Prepared, config: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def call_backward(self, fn: Any, prepared: Prepared, do: Any, dht: Any, config: Any) -> Any:
        raise NotImplementedError

    def counted_flops_per_token(self, key_dim: int, value_dim: int, chunk_size: int) -> float:
        """The forward's FLOPs per token and value head as this project counts them (``tops bench``'s ceiling):
        the chunked algorithm's matrix products, causal triangles counted whole."""
        raise NotImplementedError

    def expected_outputs(self, prepared: Prepared) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct | None]:
        """Shape and dtype of ``o`` (like ``v``) and of the final state (``None`` when not requested)."""
        v = prepared.arrays["v"]
        o = jax.ShapeDtypeStruct(tuple(v.shape), v.dtype)
        if not prepared.option("output_final_state"):
            return o, None
        if prepared.arrays.get("ssm_state_indices") is not None:
            states = prepared.arrays["initial_state"]
            return o, jax.ShapeDtypeStruct(tuple(states.shape), states.dtype)
        return o, jax.ShapeDtypeStruct(self._state_shape(prepared.spec), state_dtype(v.dtype))

    def expected_grads(self, prepared: Prepared) -> Any:
        """Shapes and dtypes of the gradients: like each given differentiable input, ``None`` for absent ones."""
        arrays = prepared.arrays
        return self.grads_type(**{
            "d" + name: None if arrays[name] is None else jax.ShapeDtypeStruct(tuple(arrays[name].shape), arrays[name].dtype)
            for name in self.differentiable
        })

    # -- shared by the contracts ------------------------------------------------------------

    def make_prepared(
        self, arrays: dict[str, Any], options: tuple[tuple[str, Any], ...], num_seqs: int,
        ndims: dict[str, int], interpret: bool, platform: str | None = None,
    ) -> Prepared:
        """Bundle a validated call with its spec; a feature is on when its array is given or its option
        is True (or set, as a number is), and ``grouped_value_heads`` when ``v`` has more heads than ``q``.

        ``platform``: the platform the call is lowered for when the caller knows it (a shard of a
        sharded call); the call is still staged per platform.
        """
        values = dict(options)
        features = {f for f in self.features if arrays.get(f) is not None or values.get(f) not in (None, False)}
        q, v = arrays["q"], arrays["v"]
        B, T, H, K = q.shape
        concrete = concrete_platform(list(arrays.values()))
        spec = CallSpec(
            op=self.name, platform=concrete or platform or host_platform(), dtype=spec_dtype(q),
            batch=B, seq_len=T, heads=H, key_dim=K, value_dim=v.shape[-1], num_seqs=num_seqs,
            features=frozenset(features), ndims=tuple(ndims.items()), interpret=interpret,
            chip=target_chip(list(arrays.values())), value_heads=v.shape[2],
        )
        traced = tuple(name for name in self.checked_when_traced(arrays, values) if not is_concrete(arrays[name]))
        return Prepared(arrays, options, spec, checked_in_program=traced, platform_known=concrete is not None)

    def checked_when_traced(self, arrays: Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, ...]:
        """The inputs with rules on their values (checked by ``prepare`` when concrete, by
        ``valid_in_program`` when traced); each op adds its own."""
        return ("cu_seqlens",) if arrays.get("cu_seqlens") is not None else ()

    def valid_in_program(self, prepared: Prepared) -> tuple[jax.Array, Prepared]:
        """For a call whose ``checked_in_program`` is not empty: whether its traced values keep the rules
        (a boolean scalar computed in the program), and the call to run in their place, whose inputs
        break no rule (invalid ``cu_seqlens`` swapped for a valid placeholder)."""
        valid = jnp.asarray(True)
        if "cu_seqlens" in prepared.checked_in_program:
            cu_seqlens = prepared.arrays["cu_seqlens"]
            valid = validation.cu_seqlens_valid(cu_seqlens, prepared.spec.seq_len)
            trusted = jnp.where(valid, cu_seqlens, validation.placeholder_cu_seqlens(prepared.spec.num_seqs, prepared.spec.seq_len))
            prepared = dataclasses.replace(prepared, arrays={**prepared.arrays, "cu_seqlens": trusted})
        return valid, prepared

    def check_cotangents(self, prepared: Prepared, do: Any, dht: Any) -> tuple[jax.Array, jax.Array | None]:
        """Validate the cotangents of an explicit ``backward`` call."""
        spec = prepared.spec
        do = validation.floating("do", validation.array("do", do, python=False))
        validation.shape("do", do, (spec.batch, spec.seq_len, spec.value_heads, spec.value_dim), "[B, T, H, V] like v")
        dht = validation.array("dht", dht, required=False, python=False)
        if dht is not None:
            states = prepared.arrays["initial_state"]
            if prepared.arrays.get("ssm_state_indices") is not None:
                validation.shape("dht", validation.floating("dht", dht), tuple(states.shape), "[P, H, K, V] like the pool initial_state")
            else:
                validation.shape("dht", validation.floating("dht", dht), self._state_shape(spec), "[N, H, K, V]")
        return do, dht

    @staticmethod
    def _state_shape(spec: CallSpec) -> tuple[int, int, int, int]:
        return (spec.num_seqs, spec.value_heads, spec.key_dim, spec.value_dim)

    # -- selection -------------------------------------------------------------------------

    def policy(self, implementation: ForceRequest = None) -> Policy:
        return current_policy(self.name, implementation)

    def decide(self, spec: CallSpec, direction: str = "forward", policy: Policy | None = None, *, warn: bool = True) -> Decision:
        """Select an implementation for a call spec (cached per spec, direction and policy).

        ``warn=False``: a forced implementation's fallback is not warned about (see ``dispatch.select``).
        """
        if spec.op != self.name:
            raise ValueError(f"call spec is for {spec.op!r}, not {self.name!r}")
        policy = self.policy() if policy is None else policy
        registry = default_registry()
        registry.warn_quarantined()
        key = (spec, direction, policy, warn)
        decision = registry.decisions.get(key)
        if decision is None:
            environment.warn_unknown()  # here, not on every call: it scans os.environ (about 12 us)
            decision = select(registry.implementations(self.name), spec, direction, policy, warn)
            registry.decisions[key] = decision
        return decision

    def decide_per_platform(self, prepared: Prepared, direction: str, policy: Policy) -> dict[str, Choice]:
        """The decision for the call's platform, and for a traced call those for every other platform.

        The call's own platform decides first and its ``NoImplementationError`` propagates; another
        platform's is recorded in its place, for the lowering to raise only if it lowers for it.
        Warning about a forced implementation's fallback is left to ``stage_per_platform``, which
        knows whether it applies wherever the program is lowered or only on some platforms.
        """
        spec = prepared.spec
        choices: dict[str, Choice] = {spec.platform: self.decide(spec, direction, policy, warn=False)}
        if prepared.platform_known:
            return choices
        for platform in PLATFORMS:
            if platform not in choices:
                try:
                    choices[platform] = self.decide(dataclasses.replace(spec, platform=platform), direction, policy, warn=False)
                except NoImplementationError as error:
                    choices[platform] = error
        return choices

    def implementations(self) -> list:
        return default_registry().implementations(self.name)

    def _explain(self, prepared: Prepared, policy: Policy) -> Explanation:
        explanation = self._explain_spec(prepared.spec, policy, warn=True)
        if prepared.arrays.get("ssm_state_indices") is not None:
            native = explanation.forward.implementation.serves_pools and self.split(prepared) is None
            note = pool.describe(prepared.arrays["initial_state"].shape[0], prepared.spec.num_seqs, native)
            explanation = dataclasses.replace(explanation, call_notes=(note,))
        if prepared.platform_known:
            return explanation
        elsewhere = []
        for platform in PLATFORMS:
            if platform != prepared.spec.platform:
                try:
                    elsewhere.append((platform, self._explain_spec(dataclasses.replace(prepared.spec, platform=platform), policy, warn=False)))
                except NoImplementationError as error:
                    elsewhere.append((platform, str(error)))
        return dataclasses.replace(explanation, elsewhere=tuple(elsewhere))

    def _explain_spec(self, spec: CallSpec, policy: Policy, warn: bool) -> Explanation:
        forward = self.decide(spec, "forward", policy, warn=warn)
        try:
            backward = self.decide(spec, "backward", policy, warn=warn)
        except NoImplementationError as error:
            return Explanation(forward, None, str(error))
        return Explanation(forward, backward)

    # -- execution -------------------------------------------------------------------------

    def _static(self, prepared: Prepared, policy: Policy) -> _Static:
        return _Static(
            self, prepared.options, prepared.spec, policy, self.split(prepared), default_registry().generation,
            prepared.checked_in_program, prepared.platform_known,
        )

    def _forward(self, prepared: Prepared, policy: Policy) -> tuple[Any, Any]:
        return _compiled(self._static(prepared, policy), dict(prepared.arrays))

    def _backward(self, prepared: Prepared, policy: Policy, do: Any, dht: Any) -> Any:
        """The explicit VJP, compiled once per static half of the call as ``forward`` is."""
        return _compiled_backward(self._static(prepared, policy), dict(prepared.arrays), do, dht)

    def kept_residuals(self, prepared: Prepared, policy: Policy, split: Split | None) -> Residuals | None:
        """The residuals the call's forward hands its backward under ``grad`` or ``vjp``, or None: the backward recomputes.

        Kept where the implementation the call's platform (its mesh's, split) decides runs both directions
        (``Implementation.residuals``), and where the call is split over no sequence: a pool call (whose forward writes
        rows in place), one split over the sequence, or one the compiler might split over it (several devices, lowered
        for anything but a TPU, whose lowering keeps a call whole: ``tops_core.partitioning``) hands on nothing."""
        if prepared.arrays.get("ssm_state_indices") is not None:
            return None
        if split["t"] if split is not None else (jax.device_count() > 1 and prepared.spec.platform != "tpu"):
            return None
        spec = _split_spec(prepared, split)
        try:
            forward = self.decide(spec, "forward", policy, warn=False)
            backward = self.decide(spec, "backward", policy, warn=False)
        except NoImplementationError:
            return None
        if not (forward.implementation.residuals and same_choice(forward, backward)):
            return None
        call = functools.partial(self.call_forward, functools.partial(forward.implementation.forward, residuals=True))
        shapes = jax.eval_shape(lambda arrays: call(dataclasses.replace(prepared, arrays=arrays), forward.config)[1], dict(prepared.arrays))
        self._check_residuals(forward.implementation.name, prepared, shapes)
        return Residuals(forward, shapes)

    def _run_forward(
        self, prepared: Prepared, policy: Policy, split: Split | None, residuals: Residuals | None = None,
    ) -> tuple[Any, Any]:
        """The call's outputs; with ``residuals``, and those residuals: ``(outputs, residuals)``."""
        if residuals is not None:  # never a pool call (kept_residuals)
            return self._checked(prepared, lambda trusted: self._partitioned("forward", trusted, policy, (), split, residuals))
        indices = prepared.arrays.get("ssm_state_indices")
        if indices is not None and split is None:
            # Decided per implementation (_staged): one that serves pools reads and writes the rows in place.
            return self._checked(prepared, lambda trusted: self._staged("forward", policy, trusted, ()))
        if indices is not None:
            # Split over devices by the caller, the sequences' rows are gathered first and split with the call.
            return _pool_written(prepared, self._run_forward(_dense(prepared), policy, split))
        return self._checked(prepared, lambda trusted: self._partitioned("forward", trusted, policy, (), split))

    def _run_backward(
        self, prepared: Prepared, policy: Policy, do: Any, dht: Any, split: Split | None,
        residuals: tuple[Residuals, Any] | None = None,
    ) -> Any:
        """The call's gradients; ``residuals``: what its forward kept (``kept_residuals``) and their values."""
        if residuals is not None:
            return self._checked(prepared, lambda trusted: self._partitioned("backward", trusted, policy, (do, dht), split, residuals))
        indices = prepared.arrays.get("ssm_state_indices")
        if indices is not None:
            states = prepared.arrays["initial_state"]
            rows_dht = None if dht is None else pool.row_cotangents(dht, indices)
            grads = self._run_backward(_dense(prepared), policy, do, rows_dht, split)
            return dataclasses.replace(grads, dinitial_state=pool.gradient(states, indices, grads.dinitial_state, dht))
        return self._checked(prepared, lambda trusted: self._partitioned("backward", trusted, policy, (do, dht), split))

    def _checked(self, prepared: Prepared, run: Any) -> Any:
        """``run(prepared)``, where the traced values of ``prepared.checked_in_program`` are checked in the program first.

        An implementation only ever sees inputs that keep the rules (``valid_in_program``), and every
        floating result of a call that breaks one becomes NaN: an invalid traced input never yields a
        plausible number (docs/ops.md "Invalid input").

        A pool call's results are made NaN through its inputs instead (``rules_kept``, ``_pool_forward``):
        its rows are written in place, and masking the returned pool would cost a pass over every row and
        lose the states of requests the call does not touch.
        """
        if not prepared.checked_in_program:
            return run(prepared)
        valid, trusted = self.valid_in_program(prepared)
        if prepared.arrays.get("ssm_state_indices") is not None:
            return run(dataclasses.replace(trusted, rules_kept=valid))
        results = run(trusted)
        return jax.tree.map(lambda x: jnp.where(valid, x, jnp.asarray(jnp.nan, x.dtype)), results)

    def _staged(
        self, direction: str, policy: Policy, prepared: Prepared, cotangents: tuple[Any, ...],
        residuals: tuple[Residuals, Any] | Residuals | None = None,
    ) -> Any:
        """The call run by the implementation each platform's dispatcher chose (staged per platform). With ``residuals``
        (``Residuals`` forward, ``(Residuals, values)`` backward), the platforms whose decision is theirs hand them on and
        take them; every other platform's forward returns zeros in their place and its backward ignores them."""
        choices = self.decide_per_platform(prepared, direction, policy)
        kept = residuals[0] if isinstance(residuals, tuple) else residuals
        if direction == "forward":
            def run_forward(decision: Decision, operands: tuple[dict[str, Any], Any]) -> tuple[Any, Any]:
                arrays, rules_kept = operands  # a branch may close over no traced value: rules_kept comes as an operand
                call = dataclasses.replace(prepared, arrays=arrays, rules_kept=rules_kept)
                if arrays.get("ssm_state_indices") is not None:
                    return self._pool_forward(decision, call, run_forward)
                forward = decision.implementation.forward
                keeps = kept is not None and same_choice(decision, kept.decision)
                with _named(decision):
                    results = self.call_forward(functools.partial(forward, residuals=True) if keeps else forward, call, decision.config)
                outputs = results[0] if keeps else results
                self._check_outputs(decision.implementation.name, call, outputs)
                if kept is None:
                    return outputs
                if keeps:
                    self._check_residuals(decision.implementation.name, call, results[1], kept.shapes)
                    return results
                return outputs, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), kept.shapes)

            operands = (dict(prepared.arrays), prepared.rules_kept)
            expected = (lambda: self.expected_outputs(prepared)) if kept is None else (lambda: (self.expected_outputs(prepared), kept.shapes))
            return stage_per_platform(choices, run_forward, operands, expected)

        def run_backward(decision: Decision, operands: tuple[dict[str, Any], Any, Any]) -> Any:
            arrays, do, dht, *values = operands
            backward = decision.implementation.backward
            if values and same_choice(decision, kept.decision):
                backward = functools.partial(backward, residuals=values[0])
            with _named(decision):
                grads = self.call_backward(backward, dataclasses.replace(prepared, arrays=arrays), do, dht, decision.config)
            self._check_grads(decision.implementation.name, arrays, grads)
            return grads

        operands = (dict(prepared.arrays), *cotangents, *(() if residuals is None else (residuals[1],)))
        return stage_per_platform(choices, run_backward, operands, lambda: self.expected_grads(prepared))

    def _pool_forward(self, decision: Decision, call: Prepared, run_forward: Any) -> tuple[Any, Any]:
        """A pool call's forward by ``decision``: in place by an implementation that serves pools, else on the
        gathered rows (``run_forward`` of the dense call) written back. A traced index that breaks a rule, or a
        traced value that does (``rules_kept``), is made NaN in the inputs a pool-serving forward gets
        (``pool.served``, ``poisoned``), never by a pass over the pool."""
        arrays = call.arrays
        indices, states = arrays["ssm_state_indices"], arrays["initial_state"]
        if not decision.implementation.serves_pools:
            o, final_states = run_forward(decision, (dict(_dense(call).arrays), None))
            if call.rules_kept is not None:
                o, final_states = (None if x is None else nan_where(~call.rules_kept, x) for x in (o, final_states))
            return _pool_written(call, (o, final_states))
        served, bad = pool.served(
            indices, states.shape[0], packed=arrays.get("cu_seqlens") is not None,
            writes=call.option("output_final_state"), rules_kept=call.rules_kept,
        )
        call = dataclasses.replace(call, arrays=self.poisoned(dict(arrays), bad))
        forward = functools.partial(decision.implementation.forward, ssm_state_indices=served)
        with _named(decision):
            outputs = self.call_forward(forward, call, decision.config)
        self._check_outputs(decision.implementation.name, call, outputs)
        return outputs

    def poisoned(self, arrays: dict[str, Any], bad: jax.Array) -> dict[str, Any]:
        """``arrays`` with a NaN in the input that makes a sequence's whole state NaN from its first token on, for the
        sequences ``bad`` marks (``[N]``, or a scalar for all of a packed call's): ``v`` here, which every op multiplies
        into its state; an op names a smaller input where it has one."""
        return {**arrays, "v": nan_where(bad, arrays["v"])}

    # -- sharding --------------------------------------------------------------------------

    def _partitioned(
        self, direction: str, prepared: Prepared, policy: Policy, cotangents: tuple[Any, ...], split: Split | None,
        residuals: tuple[Residuals, Any] | Residuals | None = None,
    ) -> Any:
        """The staged call, split over devices (``tops_core.partitioning``): over ``split``
        (``tops_core.parallel.shard``), or, when it is ``None``, as the compiler finds the inputs sharded.

        Each device's block is decided afresh by the dispatcher for its own shapes, on the mesh's
        platform; a split sequence goes through ``split_sequence``. ``residuals``: as ``_staged``'s, split
        with the batch and the heads (a sequence is never split where they are kept).
        """
        kept = residuals[0] if isinstance(residuals, tuple) else residuals
        named = [(name, prepared.arrays[name]) for name in self.dims if prepared.arrays[name] is not None]  # q first
        named += [(name, x) for name, x in zip(("do", "dht"), cotangents) if x is not None]
        values = jax.tree.leaves(residuals[1]) if isinstance(residuals, tuple) else []
        names = [name for name, _ in named]

        def unflatten(flat: tuple[Any, ...]) -> tuple[dict[str, Any], tuple[Any, ...], Any]:
            given = dict(zip(names, flat))
            arrays = {name: given.get(name) for name in prepared.arrays}
            cotangents_given = tuple(given.get(name) for name in ("do", "dht")[: len(cotangents)])
            if not isinstance(residuals, tuple):
                return arrays, cotangents_given, kept
            return arrays, cotangents_given, (kept, jax.tree.unflatten(jax.tree.structure(residuals[1]), flat[len(names):]))

        def whole(*flat: Any) -> Any:
            arrays, cotangents, residuals = unflatten(flat)
            return self._staged(direction, policy, dataclasses.replace(prepared, arrays=arrays), cotangents, residuals)

        def local(platform: str | None, sequence: SequenceShards | None, *flat: Any) -> Any:
            arrays, cotangents, residuals = unflatten(flat)
            if residuals is not None:
                if sequence is not None:
                    raise AssertionError("a call whose residuals are kept is never split over its sequence (kept_residuals)")
                block = kept.block(arrays["q"].shape[0], arrays["v"].shape[2])
                residuals = (block, residuals[1]) if isinstance(residuals, tuple) else block

            def run(arrays: dict[str, Any], cotangents: tuple[Any, ...] = cotangents, *, forward: bool = False, **options: Any) -> Any:
                block = self._block(prepared, arrays, platform, options)
                return self._staged("forward" if forward else direction, policy, block, () if forward else cotangents, residuals)

            if sequence is None:
                return run(arrays)
            return self.split_sequence(direction, prepared, arrays, cotangents, sequence, run)

        if direction == "forward":
            expected = self.expected_outputs(prepared)
            results = [("o", expected[0])] + ([("final_state", expected[1])] if expected[1] is not None else [])
            if kept is not None:
                expected = (expected, kept.shapes)
        else:
            expected = self.expected_grads(prepared)
            results = [("d" + name, getattr(expected, "d" + name)) for name in self.differentiable if prepared.arrays[name] is not None]
        residual_dims = [] if kept is None else [_residual_dims(n, x.ndim) for n, x in enumerate(jax.tree.leaves(kept.shapes))]
        plan = Plan(
            operand_dims=tuple(self._dims(name, x.ndim, prepared) for name, x in named) + tuple(residual_dims if values else ()),
            result_dims=tuple(self._dims(name, len(x.shape), prepared) for name, x in results)
            + tuple(residual_dims if direction == "forward" else ()),
            out_tree=jax.tree.structure(expected),
            local=local,
            unsplittable_sequence=self.sequence_unsplittable(prepared),
        )
        return partitioned(plan, [x for _, x in named] + values, whole, split)

    dims: ClassVar[Mapping[str, str]]
    """Each array's dimensions as factors (``"b t h k"``): ``b`` batch, ``t`` time and ``h`` heads may
    be split over devices; ``n`` (sequences) is ``b`` when nothing is packed."""

    _DIMS_LIKE: ClassVar[Mapping[str, str]] = {"o": "v", "do": "v", "final_state": "initial_state", "dht": "initial_state"}

    def gate_inputs(self, features: frozenset[str]) -> dict[str, str]:
        """The per-token inputs besides ``q``, ``k`` and ``v`` that a call with ``features`` passes (``g``, ``beta``),
        each with what one token and value head holds of it: ``"k"`` (one per key) or ``"1"``. Read from ``dims``:
        an input with a time factor, given when it is not optional or is among the features."""
        gates = {}
        for name, dims in self.dims.items():
            factors = dims.split()
            if name not in ("q", "k", "v") and "t" in factors and (name not in self.features or name in features):
                gates[name] = "k" if factors[-1] == "k" else "1"
        return gates

    def _dims(self, name: str, ndim: int, prepared: Prepared) -> tuple[str, ...]:
        array = self._DIMS_LIKE.get(name, name if name in self.dims else name.removeprefix("d"))
        dims = self.dims[array].split()
        if prepared.arrays.get("cu_seqlens") is None:
            dims = ["b" if f == "n" else f for f in dims]
        return tuple(dims[len(dims) - ndim:])  # a scalar g_gamma has no heads factor

    def _block(self, prepared: Prepared, arrays: dict[str, Any], platform: str | None, options: Mapping[str, Any]) -> Prepared:
        """One device's block of a sharded call: its arrays and the call spec of their shapes, on ``platform``."""
        num_seqs = prepared.spec.num_seqs if arrays.get("cu_seqlens") is not None else arrays["q"].shape[0]
        options = tuple({**dict(prepared.options), **options}.items())
        return self.make_prepared(arrays, options, num_seqs, dict(prepared.spec.ndims), prepared.spec.interpret, platform=platform)

    def split(self, prepared: Prepared) -> Split | None:
        """How the call is split over devices when that is known now: the ``tops_core.parallel.shard``
        block it is in, else the split ``q``'s type carries over explicit mesh axes."""
        return parallel.current() or Split.from_types(prepared.arrays["q"], self._dims("q", 4, prepared))

    sequence_parallel: ClassVar[Any] = None
    """The module that splits this op's sequence over devices (``forward`` and ``backward`` of one device's block, as
    ``tops_core.ops.diagonal_sequence`` has them); ``None``: its batch or heads may be split, not its sequence."""

    def sequence_unsplittable(self, prepared: Prepared) -> str | None:
        """Why this call's sequence cannot be split over devices (``None``: it can, with ``split_sequence``)."""
        if self.sequence_parallel is not None:
            return None
        return f"{self.name} has no sequence-parallel algorithm; shard the batch or the heads instead"

    def split_sequence(
        self, direction: str, prepared: Prepared, arrays: dict[str, Any], cotangents: tuple[Any, ...],
        sequence: SequenceShards, run: Any,
    ) -> Any:
        """One device's results when the sequence is split over ``sequence``; ``run(arrays, cotangents, **options)``
        runs the op on a block (``forward=True``: its forward, in the backward too). Results that do not have a time
        axis are this device's share of a sum."""
        if self.sequence_parallel is None:
            raise NotImplementedError(self.sequence_unsplittable(prepared))
        if direction == "forward":
            return self.sequence_parallel.forward(arrays, prepared, sequence, run)
        return self.sequence_parallel.backward(arrays, cotangents, prepared, sequence, run)

    def _check_outputs(self, impl: str, prepared: Prepared, outputs: Any) -> None:
        if not (isinstance(outputs, tuple) and len(outputs) == 2):
            raise ContractError(f"{impl} forward must return (o, final_state), got {type(outputs).__name__}")
        for label, got, want in zip(("o", "final_state"), outputs, self.expected_outputs(prepared)):
            if want is None:
                if got is not None:
                    raise ContractError(f"{impl} returned a {label} that was not requested")
                continue
            if got is None or tuple(got.shape) != want.shape or jnp.dtype(got.dtype) != want.dtype:
                described = None if got is None else f"{tuple(got.shape)} {jnp.dtype(got.dtype).name}"
                raise ContractError(f"{impl} returned {label} {described}; the contract says {want.shape} {want.dtype.name}")

    def _check_residuals(self, impl: str, prepared: Prepared, residuals: Any, expected: Any = None) -> None:
        """A forward's residuals are arrays ``[B, HV, ...]`` (batch and value heads first: they split with the call), and
        the same wherever the call is traced."""
        leaves = jax.tree.leaves(residuals)
        if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
            raise ContractError(f"{impl} forward returned residuals that are not arrays: {residuals!r}")
        B, HV = prepared.arrays["q"].shape[0], prepared.arrays["v"].shape[2]
        for x in leaves:
            if len(x.shape) < 2 or tuple(x.shape[:2]) != (B, HV):
                raise ContractError(f"{impl} forward returned a residual of shape {tuple(x.shape)}; residuals are [B, HV, ...] = [{B}, {HV}, ...]")
        if expected is not None and jax.tree.structure(residuals) != jax.tree.structure(expected):
            raise ContractError(f"{impl} forward returned residuals {jax.tree.structure(residuals)}; traced before as {jax.tree.structure(expected)}")

    def _check_grads(self, impl: str, arrays: Mapping[str, Any], grads: Any) -> None:
        if not isinstance(grads, self.grads_type):
            raise ContractError(f"{impl} backward must return {self.grads_type.__name__}, got {type(grads).__name__}")
        for name in self.differentiable:
            x, dx = arrays[name], getattr(grads, "d" + name)
            if x is None:
                if dx is not None:
                    raise ContractError(f"{impl} returned d{name} for an absent {name}")
                continue
            if dx is None:
                raise ContractError(f"{impl} returned no d{name}; every given input gets a gradient")
            if tuple(dx.shape) != tuple(x.shape) or jnp.dtype(dx.dtype) != jnp.dtype(x.dtype):
                raise ContractError(
                    f"{impl} returned d{name} {tuple(dx.shape)} {jnp.dtype(dx.dtype).name}; "
                    f"expected {tuple(x.shape)} {jnp.dtype(x.dtype).name} like {name}"
                )


@dataclasses.dataclass(frozen=True, eq=False)
class Residuals:
    """What a call's forward hands its backward beyond the inputs (``OpContract.kept_residuals``): ``decision``'s
    implementation's, with their ``shapes`` (a pytree of ``ShapeDtypeStruct``, each ``[B, HV, ...]``)."""

    decision: Decision
    shapes: Any

    def block(self, batch: int, value_heads: int) -> Residuals:
        """Those of one device's block of ``batch`` sequences and ``value_heads`` heads."""
        def blocked(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct((batch, value_heads, *x.shape[2:]), x.dtype)

        return Residuals(self.decision, jax.tree.map(blocked, self.shapes))


def _split_spec(prepared: Prepared, split: Split | None) -> CallSpec:
    """The call's spec on the platform of the mesh it is split over, where that is known."""
    if split is None or split.platform is None:
        return prepared.spec
    return dataclasses.replace(prepared.spec, platform=split.platform)


def _residual_dims(leaf: int, ndim: int) -> tuple[str, ...]:
    """A residual's factors: the batch and the heads, split with the call, then its own (``r<leaf>d<axis>``), whole."""
    return ("b", "h", *(f"r{leaf}d{axis}" for axis in range(2, ndim)))


def _dense(prepared: Prepared) -> Prepared:
    """A pool call (``ssm_state_indices``) as the dense call of its sequences, which start from their pool rows."""
    arrays = prepared.arrays
    rows = pool.rows(arrays["initial_state"], arrays["ssm_state_indices"])
    return dataclasses.replace(prepared, arrays={**arrays, "initial_state": rows, "ssm_state_indices": None})


def nan_where(bad: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` with NaN in the sequences ``bad`` marks: ``[N]`` along ``x``'s first axis, or a scalar for all of it."""
    bad = bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim))
    return jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)


def _pool_written(prepared: Prepared, outputs: tuple[Any, Any]) -> tuple[Any, Any]:
    """The outputs of a pool call from those of its dense call: the final states written into the pool."""
    o, final_states = outputs
    if final_states is None:
        return o, None
    return o, pool.written(prepared.arrays["initial_state"], prepared.arrays["ssm_state_indices"], final_states)


def _named(decision: Decision) -> Any:
    """Name what an implementation stages ``<implementation>.<direction>``: the compiled program and profiles say who ran."""
    return jax.named_scope(f"{decision.implementation.name}.{decision.direction}")


@dataclasses.dataclass(frozen=True)
class _Static:
    """The hashable, non-differentiable half of a call: what the custom VJP closes over."""

    contract: OpContract
    options: tuple[tuple[str, Any], ...]
    spec: CallSpec
    policy: Policy
    split: Split | None
    registry_generation: int
    checked_in_program: tuple[str, ...]
    platform_known: bool

    def prepared(self, arrays: Mapping[str, Any]) -> Prepared:
        return Prepared(arrays, self.options, self.spec, self.checked_in_program, self.platform_known)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(static: _Static, arrays: dict[str, Any]) -> tuple[Any, Any]:
    return static.contract._run_forward(static.prepared(arrays), static.policy, static.split)


def _differentiable_fwd(static: _Static, arrays: dict[str, Any]):
    prepared = static.prepared(arrays)
    kept = static.contract.kept_residuals(prepared, static.policy, static.split)
    if kept is None:
        return static.contract._run_forward(prepared, static.policy, static.split), (arrays, None)
    outputs, values = static.contract._run_forward(prepared, static.policy, static.split, kept)
    return outputs, (arrays, values)


def _explicit_backward(static: _Static, arrays: dict[str, Any], do: Any, dht: Any) -> Any:
    return static.contract._run_backward(static.prepared(arrays), static.policy, do, dht, static.split)


def _differentiable_bwd(static: _Static, residuals: tuple[dict[str, Any], Any], cotangents: tuple[Any, Any]):
    arrays, values = residuals
    prepared = static.prepared(arrays)
    kept = None
    if values is not None:  # the forward's decision (cached), with the shapes of what it kept
        decision = static.contract.decide(_split_spec(prepared, static.split), "forward", static.policy, warn=False)
        kept = (Residuals(decision, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), values)), values)
    grads = static.contract._run_backward(prepared, static.policy, *cotangents, static.split, kept)
    return ({name: getattr(grads, "d" + name) if name in static.contract.differentiable else None for name in arrays},)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)

# Eager calls of a custom_vjp function re-trace it every time (about a millisecond); under jit
# they cost one cached dispatch. Inside an outer jit/grad/vmap the inner jit is simply inlined.
# The registry generation is part of the static key, so a new registration re-traces.
_compiled = jax.jit(_differentiable, static_argnums=0)
# The explicit backward likewise: uncompiled, an eager call traced and compiled its program afresh
# every time (seconds per call for kda on CPU).
_compiled_backward = jax.jit(_explicit_backward, static_argnums=0)
