"""The ``tops`` command: plugins, implementations, decisions, and the benchmark main job."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform as python_platform
import re
import sys
import warnings
from collections.abc import Sequence

from tops_core.callspec import PLATFORMS, CallSpec
from tops_core.capabilities import FLOAT_DTYPES
from tops_core.conformance.cases import Case
from tops_core.dispatch import NoImplementationError, pairing_note
from tops_core.ops import CONTRACTS, op
from tops_core.ops.base import ContractError, platform_of
from tops_core.policy import Force, current_policy, deny_patterns
from tops_core.registry import PluginError, default_registry
from tops_core.tpu import compile_only
from tops_core.tpu.generations import GENERATIONS

DEFAULT_SHAPE = "2,4096,8,128,128"
PACKED_DEFAULT_SHAPE = "1,8192,8,128,128"
"""With ``cu_seqlens`` (which needs ``B == 1``): the default's tokens packed into one row."""
DEFAULT_DTYPES = "float32 on cpu, bfloat16 on gpu and tpu"


class UsageError(Exception):
    """A command line that cannot be run as written; printed as one line."""


def versions() -> str:
    """tops-core, jax and jaxlib versions, and the Python running them."""
    def version(distribution: str) -> str:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (f"tops-core {version('tops-core')}; jax {version('jax')}, jaxlib {version('jaxlib')}; "
            f"Python {python_platform.python_version()}")


def cmd_plugins(args: argparse.Namespace) -> int:
    import jax

    registry = default_registry()
    print(versions())
    devices = jax.devices()
    described = ", ".join(f"{d.device_kind} ({d.platform}:{d.id})" for d in devices[:8]) + (f", ... ({len(devices)} in all)" if len(devices) > 8 else "")
    print(f"backend: {jax.default_backend()}; devices: {described}\n")
    rows = [("plugin", "distribution", "version", "implementations")]
    for info in sorted(registry.plugins(), key=lambda p: p.name):
        implementations = ", ".join(f"{impl} ({op})" for op, impl in info.implementations) or "-"
        rows.append((info.name, info.distribution or f"({info.source})", info.version or "-", implementations))
    print(_table(rows))
    for note in registry.environment_notes():
        print(f"note: {note}")
    quarantined = registry.quarantined()
    if quarantined:
        print(f"\nquarantined ({len(quarantined)}):")
        for plugin in quarantined:
            print(f"  {plugin.name} ({plugin.distribution or '?'} {plugin.version or ''}): {plugin.error}".replace(" )", ")"))
            if args.verbose:
                print("    " + plugin.details.rstrip().replace("\n", "\n    "))
        return 1
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    names = [args.op] if args.op else sorted(CONTRACTS)
    for index, name in enumerate(names):
        contract = op(name)
        implementations = sorted(contract.implementations(), key=lambda impl: impl.name)
        if index:
            print()
        print(f"{name}: {len(implementations)} implementation(s)")
        if not implementations:
            continue
        print(_table(_support_matrix(contract, implementations), indent="  "))
        for impl in implementations:
            print(f"\n  {impl.name}: {_plain(impl.description) or '(no description)'}")
            print(f"    priority: {_describe_priority(impl.priority)}")
            caps = impl.capabilities
            ndims = "; ".join(f"{k}.ndim in {{{', '.join(map(str, sorted(v)))}}}" for k, v in caps.ndims)
            print(f"    K: {caps.key_dim.describe()}; V: {caps.value_dim.describe()}" + (f"; {ndims}" if ndims else ""))
            if caps.requires:
                print(f"    requires: {', '.join(sorted(caps.requires))}")
            if caps.predicate is not None:
                print(f"    further limits: {_plain(caps.predicate.__doc__ or caps.predicate.__name__)}")
            if impl.serves_pools:
                print("    state pools (ssm_state_indices): the forward reads and writes the rows in place")
            print(f"    config: {impl.config!r}")
    print("\ny = supported, i = runs in Pallas' TPU interpreter when interpret mode is on, - = not supported")
    return 0


def _support_matrix(contract, implementations) -> list[tuple[str, ...]]:
    features = sorted(contract.features)
    header = ("implementation", *PLATFORMS, *(_short_dtype(d) for d in FLOAT_DTYPES), *features, "backward")
    rows = [header]
    for impl in implementations:
        caps = impl.capabilities
        platforms = ["y" if p in caps.platforms else ("i" if caps.interpretable else "-") for p in PLATFORMS]
        dtypes = ["y" if d in caps.dtypes else "-" for d in FLOAT_DTYPES]
        flags = ["y" if f in caps.features else "-" for f in features]
        rows.append((impl.name, *platforms, *dtypes, *flags, "y" if impl.backward is not None else "-"))
    return rows


def _short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}[dtype]


def _describe_priority(priority) -> str:
    if callable(priority):
        return f"depends on the call ({_plain(priority.__doc__ or priority.__name__)})"
    return ", ".join(f"{platform} {value}" for platform, value in sorted(priority.items())) or "0 everywhere"


def _plain(text: str) -> str:
    """A docstring as one line of terminal text: its lines joined, RST's ``literal`` shown as `literal`."""
    return re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))


def cmd_explain(args: argparse.Namespace) -> int:
    contract = op(_op_name(args))
    spec = _spec_from_args(contract, args)
    policy = current_policy(contract.name)
    policy = dataclasses.replace(
        policy,
        force=Force(args.force, (), "--force") if args.force else policy.force,
        deny=policy.deny | deny_patterns(_parse_list(",".join(args.deny)), "--deny"),
        strict=policy.strict or args.strict,
        interpret=policy.interpret or args.interpret,
    )
    if policy.force is not None:
        registered = {impl.name for impl in contract.implementations()}
        if policy.force.implementation not in registered:
            raise UsageError(f"unknown implementation {policy.force.implementation!r} of {contract.name}; registered: {', '.join(sorted(registered)) or 'none'}")
    spec = dataclasses.replace(spec, interpret=policy.interpret)
    decisions = {}
    for direction in ("forward", "backward"):
        try:
            decisions[direction] = contract.decide(spec, direction, policy)
            print(decisions[direction].explain())
        except NoImplementationError as error:
            print(error)
    if len(decisions) < 2:
        return 1
    pairing = pairing_note(decisions["forward"], decisions["backward"])
    if pairing:
        print(pairing)
    return 0


def _features(contract, args: argparse.Namespace) -> list[str]:
    from tops_core import bench

    features = _parse_list(args.with_features) if args.with_features is not None else list(bench.DEFAULT_FEATURES[contract.name])
    unknown = set(features) - contract.features
    if unknown:
        raise UsageError(f"unknown feature(s) {sorted(unknown)} for {contract.name}; known: {', '.join(sorted(contract.features))}")
    if args.num_seqs is not None and "cu_seqlens" not in features:
        raise UsageError("--num-seqs describes packed sequences: add cu_seqlens to --with")
    missing = contract.signature.missing(frozenset(features))
    if missing:
        raise UsageError(f"--with {','.join(features)}: " + "; ".join(missing))
    if args.value_heads is not None:
        if "grouped_value_heads" not in contract.features:
            raise UsageError(f"--value-heads describes grouped value heads, which {contract.name} does not have")
        features = sorted(set(features) | {"grouped_value_heads"})
    return features


def _value_heads(features: list[str], H: int, args: argparse.Namespace) -> int:
    """``v``'s heads: ``--value-heads``, else twice ``H`` with ``grouped_value_heads``, else ``H``."""
    if args.value_heads is not None:
        if args.value_heads <= H or args.value_heads % H:
            raise UsageError(f"--value-heads must be a multiple of H = {H} above it, got {args.value_heads}")
        return args.value_heads
    return 2 * H if "grouped_value_heads" in features else H


def _shape_text(args: argparse.Namespace, features) -> str:
    """``--shape``, else the default for the call: ``PACKED_DEFAULT_SHAPE`` with ``cu_seqlens``."""
    if args.shape is not None:
        return args.shape
    return PACKED_DEFAULT_SHAPE if "cu_seqlens" in features else DEFAULT_SHAPE


def _spec_from_args(contract, args: argparse.Namespace) -> CallSpec:
    features = set(_features(contract, args))
    shape = _shape_text(args, features)
    B, T, H, K, V = _parse_shape(shape)
    ndims = {name: 1 for name in contract.variable_ndims if name in features}
    for item in args.ndim:
        name, _, value = item.partition("=")
        if name not in contract.variable_ndims or name not in features or not value.isdigit():
            raise UsageError(f"--ndim takes NAME=RANK for a given input of variable rank ({', '.join(sorted(contract.variable_ndims)) or 'none'}), got {item!r}")
        ndims[name] = int(value)
    if "cu_seqlens" in features and B != 1:
        raise UsageError(f"cu_seqlens packs the sequences along T and requires B == 1, got --shape {shape}")
    num_seqs = (args.num_seqs or 1) if "cu_seqlens" in features else B
    if args.chip and args.platform != "tpu":
        raise UsageError(f"--chip names the TPU generation a call is lowered for; it needs --platform tpu, not {args.platform}")
    return CallSpec(
        op=contract.name, platform=args.platform, dtype=args.dtype or _default_dtype(args.platform), batch=B, seq_len=T,
        heads=H, key_dim=K, value_dim=V, num_seqs=num_seqs, features=frozenset(features), ndims=tuple(ndims.items()),
        chip=args.chip, value_heads=_value_heads(sorted(features), H, args),
    )


def _default_dtype(platform: str) -> str:
    from tops_core import bench

    return bench.default_dtype(platform)


def cmd_bench(args: argparse.Namespace) -> int:
    from tops_core import bench

    if args.decode:
        return cmd_bench_decode(args)
    if args.pool is not None:
        raise UsageError("--pool sizes the state pool of a decode step: use it with --decode")
    contract = op(_op_name(args))
    features = _features(contract, args)
    platform = platform_of([])
    try:
        shape = _parse_shape(_shape_text(args, features))
        case = bench.workload(contract.name, shape, args.dtype or _default_dtype(platform), features, args.num_seqs,
                              value_heads=_value_heads(features, shape[2], args))
    except ValueError as error:
        raise UsageError(str(error)) from None
    names = _parse_list(",".join(args.impl))
    generation = args.tpu if args.tpu != "none" and platform != "tpu" else None
    tpu_case = dataclasses.replace(case, dtype=args.dtype or _default_dtype("tpu"))  # the modelled section's: bf16 unless --dtype says
    with bench.dtype_scope(case):
        not_measured = _tpu_only(contract, case, tpu_case, platform, names)
        if not_measured and generation is None:
            name, why = not_measured[0]
            raise UsageError(f"{name} cannot run this workload here: {why}; "
                             f"--tpu GEN ({', '.join(sorted(GENERATIONS))}) models it on a compile-only TPU instead")
        measured = [name for name in names if name not in dict(not_measured)]
        measuring = bool(measured) or not names
        if measuring:
            bench.candidates(case, platform, measured)  # unknown or unsupported names fail before any work
            bench.check_memory(case, platform)
    if args.plot:
        if not measuring:
            raise UsageError(f"--plot draws times measured here, and none of --impl {','.join(names)} runs here")
        _check_writable(args.plot)
        bench.pyplot()
        bench.check_memory(bench.plot_workloads(case)[-1], platform)
    if not args.json:
        print(bench.describe_workload(case, platform), flush=True)
    if measuring:
        report = bench.run(case, measured, budget=args.budget)
    else:
        report = bench.Report(case, None, platform, False, [], accuracy_not_checked="nothing ran on this machine")
    if not args.json and report.rows:
        print("\n" + bench.format_report(report, header=False))
    if not args.json and not_measured:
        print("\n" + "\n".join(f"{name}: not measured here, {why}; modelled on TPU {generation} below."
                                for name, why in not_measured))
    if args.plot:
        bench.plot(case, measured, args.plot)
        if not args.json:
            print(f"\nwrote {args.plot}")
    model = _tpu_model(tpu_case, generation, names) if generation else None
    unbounded = _without_lower_bound(contract, tpu_case)
    exact_model = _tpu_model(unbounded, generation, names) if generation and unbounded else None
    if args.json:
        document = {**bench.report_json(report), "not_measured": [{"implementation": name, "why": why} for name, why in not_measured],
                    "failures": bench.failures(report), "modelled_tpu": None}
        if model is not None:
            from tops_core.tpu import model as tpu_model

            document["modelled_tpu"] = tpu_model.model_json(model)
            if exact_model is not None:
                document["modelled_tpu_without_lower_bound"] = tpu_model.model_json(exact_model)
        print(json.dumps(document, indent=1, default=str))
    elif model is not None:
        from tops_core.tpu import model as tpu_model

        print("\n" + tpu_model.format_model(model))
        if exact_model is not None:
            print("\nThe same call without lower_bound (the kernels' exact path, for comparison):\n" + tpu_model.format_model(exact_model))
    if report.rows and report.accuracy_not_checked:
        _warn(f"accuracy not checked: {report.accuracy_not_checked}")
    failed = bench.failures(report)
    if failed:
        print(f"\nFAIL: {', '.join(failed)} outside the tolerance for {case.dtype}", file=sys.stderr)
        return 1
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    """``tops bench --decode``: a decode step on a state pool, each implementation beside a hand-written step."""
    from tops_core import decode_bench

    contract = op(_op_name(args))
    features = _parse_list(args.with_features) if args.with_features is not None else list(decode_bench.DEFAULT_FEATURES[contract.name])
    platform = platform_of([])
    try:
        shape = _parse_shape(args.shape) if args.shape is not None else decode_bench.DEFAULT_SHAPE
        decode = decode_bench.workload(contract.name, shape, args.dtype or "float32", features, args.pool,
                                       value_heads=_value_heads(features, shape[2], args))
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.num_seqs is not None:
        raise UsageError("--num-seqs packs sequences for prefill; a decode step has B requests (--shape)")
    if args.plot:
        raise UsageError("--plot draws time against sequence length, which a decode step does not have")
    rows = decode_bench.run(decode, _parse_list(",".join(args.impl)) or None, budget=args.budget)
    generation = args.tpu if args.tpu != "none" and platform != "tpu" else None
    model = decode_bench.model_on_tpu(decode, generation) if generation else None
    if args.json:
        print(json.dumps({"workload": decode.describe(), "platform": platform, "rows": decode_bench.rows_json(rows),
                          "modelled_tpu": model}, indent=1))
    else:
        print(decode_bench.format_rows(decode, rows, platform))
        if model is not None:
            print("\n" + decode_bench.format_model(model))
    failed = [row.implementation for row in rows if not row.passed]
    if failed:
        print(f"\nFAIL: {', '.join(failed)} outside the tolerance for {decode.case.dtype}", file=sys.stderr)
        return 1
    return 0


def _tpu_only(contract, case: Case, tpu_case: Case, platform: str, names: list[str]) -> list[tuple[str, str]]:
    """The named implementations that cannot run ``case`` on this platform but run ``tpu_case`` on a TPU, and why not here.

    Off TPU, the modelled section is what a user naming a TPU kernel can have: it is modelled, not measured.
    """
    registered = {impl.name: impl for impl in contract.implementations()}
    here, on_tpu = case.spec(platform, current_policy(contract.name).interpret), tpu_case.spec("tpu", interpret=False)
    tpu_only = []
    for name in names:
        impl = registered.get(name)
        reasons = impl.reasons(here, "forward") if impl is not None else []
        if reasons and not impl.reasons(on_tpu, "forward"):
            tpu_only.append((name, "; ".join(reasons)))
    return tpu_only


def _check_writable(path: str) -> None:
    """Refuse a plot path that could not be written, before spending minutes on the benchmark."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"--plot {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--plot {path}: the directory {directory} is not writable")


def _without_lower_bound(contract, case: Case) -> Case | None:
    """A workload with ``lower_bound`` (kda's bounded gates, which kernels may exploit) without it, for the
    modelled section to show both paths; None for one without. The gate then takes ``A_log`` if it had none."""
    if "lower_bound" not in case.features:
        return None
    features = contract.signature.completed(frozenset(case.features - {"lower_bound"}))
    return case.with_features(case.name, features)


def _tpu_model(case: Case, generation: str, names: list[str]):
    """The modelled TPU section: the workload compiled for a compile-only TPU of ``generation``."""
    from tops_core import bench
    from tops_core.tpu import model as tpu_model

    with bench.dtype_scope(case):
        return tpu_model.model(case, generation, names)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise UsageError(f"--shape must be B,T,H,K,V (five positive integers), got {text!r}")
    return shape


def _op_name(args: argparse.Namespace) -> str:
    if args.op and args.op_option and args.op != args.op_option:
        raise UsageError(f"two ops named: {args.op} and --op {args.op_option}")
    name = args.op or args.op_option or args.default_op
    if name is None:
        raise UsageError(f"name the op: OP or --op OP, one of {', '.join(sorted(CONTRACTS))}")
    return name


def _parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _table(rows: list[tuple[str, ...]], indent: str = "") -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _call_arguments(parser: argparse.ArgumentParser, default_op: str | None) -> None:
    """The description of a call, shared by explain and bench (same names, same defaults).

    The op is named either way, ``tops bench kda`` or ``tops bench --op kda``; ``_op_name`` reads it.
    """
    parser.add_argument("op", nargs="?", choices=sorted(CONTRACTS), help="the op" + (f" (default: {default_op})" if default_op else ""))
    parser.add_argument("--op", dest="op_option", metavar="OP", choices=sorted(CONTRACTS), help="the same as OP")
    parser.set_defaults(default_op=default_op)
    parser.add_argument("--shape", help=f"B,T,H,K,V (default: {DEFAULT_SHAPE}, or {PACKED_DEFAULT_SHAPE} with cu_seqlens)")
    parser.add_argument("--dtype", choices=FLOAT_DTYPES, help=f"input dtype (default: {DEFAULT_DTYPES})")
    parser.add_argument("--with", dest="with_features", metavar="FEATURES",
                        help="comma-separated optional inputs and options, e.g. g_gamma,initial_state,output_final_state "
                             "(default: g_gamma for simple_gla, use_qk_l2norm for kda)")
    parser.add_argument("--num-seqs", type=_positive_integer, metavar="N", help="packed sequences, with cu_seqlens and B = 1 (default: 1)")
    parser.add_argument("--value-heads", type=_positive_integer, metavar="HV",
                        help="kda: v's heads, a multiple of H (grouped value heads; default with grouped_value_heads: 2H)")


def _positive_integer(text: str) -> int:
    """argparse type: a count, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    """argparse type: a duration in seconds, finite and above 0 (``float`` alone takes nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tops", description="Linear-attention kernels: plugins, dispatch decisions and benchmarks.")
    parser.add_argument("--version", action="version", version=versions())
    commands = parser.add_subparsers(dest="command", required=True)

    plugins = commands.add_parser("plugins", help="installed plugins, their versions, and quarantined ones with reasons (exit 1 if any)")
    plugins.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of quarantined plugins")
    plugins.set_defaults(run=cmd_plugins)

    listing = commands.add_parser("list", help="implementations and their support matrix")
    listing.add_argument("op", nargs="?", choices=sorted(CONTRACTS))
    listing.set_defaults(run=cmd_list)

    explain = commands.add_parser("explain", help="describe a call and print the dispatcher's decision trace")
    _call_arguments(explain, default_op=None)
    explain.add_argument("--ndim", action="append", default=[], metavar="NAME=RANK", help="rank of an input of variable rank (g_gamma: 0 or 1)")
    explain.add_argument("--platform", default=platform_of([]), choices=PLATFORMS, help="default: this machine's (%(default)s)")
    explain.add_argument("--chip", choices=sorted(GENERATIONS), help="with --platform tpu: the TPU generation the call is lowered for (kernels size VMEM for it; default: unknown)")
    explain.add_argument("--interpret", action="store_true", help="interpret mode: accept TPU kernels off TPU")
    explain.add_argument("--force", metavar="IMPL", help="force an implementation, e.g. xla.chunk")
    explain.add_argument("--deny", action="append", default=[], metavar="PATTERNS",
                         help="never select these implementations (names or shell patterns; repeatable or comma-separated, as TOPS_DENY)")
    explain.add_argument("--strict", action="store_true", help="no fallback past the forced or highest-priority implementation")
    explain.set_defaults(run=cmd_explain)

    bench = commands.add_parser("bench", help="benchmark every implementation that supports a workload (the main job); exit 1 if any is outside the tolerance")
    _call_arguments(bench, default_op="simple_gla")
    bench.add_argument("--impl", action="append", default=[], metavar="NAME", help="only these implementations (repeatable or comma-separated)")
    bench.add_argument("--plot", metavar="FILE", help="also write a PNG of time against sequence length (needs matplotlib)")
    bench.add_argument("--budget", type=_positive_seconds, default=2.0, help="seconds of timed repeats per measurement (default: %(default)s)")
    bench.add_argument("--tpu", default="v6e", choices=[*GENERATIONS, "none"],
                       help="off TPU, also model the TPU implementations compiled for this generation, and those named by --impl "
                            "instead of running them (needs libtpu; default: %(default)s)")
    bench.add_argument("--json", action="store_true", help="print every figure of the report (and of the modelled TPU section) as one JSON document")
    bench.add_argument("--decode", action="store_true",
                       help="a server's decode step instead: B requests of T tokens on a state pool (ssm_state_indices), donated, "
                            "beside a hand-written jax.numpy step (default shape 64,1,8,128,128, float32)")
    bench.add_argument("--pool", type=_positive_integer, metavar="P", help="with --decode: the pool's rows (default: 2B)")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    compile_only.quiet_libtpu()  # before anything starts JAX's backends, which loads libtpu where installed
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():  # restores Python's display when the command ends
            warnings.showwarning = _show_warning
            return args.run(args)
    except BrokenPipeError:
        # `tops list | head`: the reader left; say nothing more, and keep Python's exit-time flush quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, ValueError, TypeError, NoImplementationError, PluginError, ContractError) as error:
        print(f"tops: error: {_first_line(error)}", file=sys.stderr)
        return 2


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for a command: a forced implementation falling back, say, as one ``tops: warning:`` line
    instead of Python's ``file:line: RuntimeWarning:`` form, which names a line of tops rather than anything the user wrote."""
    _warn(str(message).removeprefix("tops: "))  # the dispatcher's messages name tops themselves, for Python's form


def _warn(text: str) -> None:
    print(f"tops: warning: {text}", file=sys.stderr)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0] + (" (`tops explain` shows every implementation and why)" if isinstance(error, NoImplementationError) else "")


if __name__ == "__main__":
    sys.exit(main())
