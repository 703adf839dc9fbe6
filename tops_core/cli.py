"""The ``tops`` command: plugins, implementations, decisions, and the benchmark main job."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from tops_core.callspec import PLATFORMS, CallSpec
from tops_core.capabilities import FLOAT_DTYPES
from tops_core.dispatch import NoImplementationError, pairing_note
from tops_core.ops import CONTRACTS, op
from tops_core.ops.base import platform_of
from tops_core.policy import Force, current_policy
from tops_core.registry import default_registry


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = default_registry()
    rows = [("plugin", "distribution", "version", "implementations")]
    for info in sorted(registry.plugins(), key=lambda p: p.name):
        implementations = ", ".join(f"{impl} ({op})" for op, impl in info.implementations) or "-"
        rows.append((info.name, info.distribution or f"({info.source})", info.version or "-", implementations))
    print(_table(rows))
    quarantined = registry.quarantined()
    if quarantined:
        print(f"\nquarantined ({len(quarantined)}):")
        for plugin in quarantined:
            print(f"  {plugin.name} ({plugin.distribution or '?'} {plugin.version or ''}): {plugin.error}".replace(" )", ")"))
            if args.verbose:
                print("    " + plugin.details.rstrip().replace("\n", "\n    "))
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
            print(f"\n  {impl.name}: {impl.description or '(no description)'}")
            print(f"    priority: {_describe_priority(impl.priority)}")
            caps = impl.capabilities
            ndims = "; ".join(f"{k}.ndim in {{{', '.join(map(str, sorted(v)))}}}" for k, v in caps.ndims)
            print(f"    K: {caps.key_dim.describe()}; V: {caps.value_dim.describe()}" + (f"; {ndims}" if ndims else ""))
            if caps.requires:
                print(f"    requires: {', '.join(sorted(caps.requires))}")
            if caps.predicate is not None:
                print(f"    further limits: {(caps.predicate.__doc__ or caps.predicate.__name__).strip()}")
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
        return f"depends on the call ({(priority.__doc__ or priority.__name__).strip()})"
    return ", ".join(f"{platform} {value}" for platform, value in sorted(priority.items())) or "0 everywhere"


def cmd_explain(args: argparse.Namespace) -> int:
    contract = op(args.op)
    spec = _spec_from_args(contract, args)
    policy = current_policy(contract.name)
    policy = dataclasses.replace(
        policy,
        force=Force(args.force, (), "--force") if args.force else policy.force,
        deny=policy.deny | frozenset(args.deny),
        strict=policy.strict or args.strict,
        interpret=policy.interpret or args.interpret,
    )
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


def _spec_from_args(contract, args: argparse.Namespace) -> CallSpec:
    B, T, H, K, V = _parse_shape(args.shape)
    features = set(_parse_list(args.with_features))
    unknown = features - contract.features
    if unknown:
        raise SystemExit(f"unknown feature(s) {sorted(unknown)} for {contract.name}; known: {', '.join(sorted(contract.features))}")
    ndims = {name: 1 for name in contract.variable_ndims if name in features}
    for item in args.ndim:
        name, _, value = item.partition("=")
        if name not in contract.variable_ndims or name not in features or not value.isdigit():
            raise SystemExit(f"--ndim takes NAME=RANK for a given input of variable rank ({', '.join(sorted(contract.variable_ndims)) or 'none'}), got {item!r}")
        ndims[name] = int(value)
    num_seqs = args.num_seqs if "cu_seqlens" in features else B
    if "cu_seqlens" in features and B != 1:
        raise SystemExit("cu_seqlens requires B == 1 (sequences packed along T)")
    return CallSpec(
        op=contract.name, platform=args.platform, dtype=args.dtype, batch=B, seq_len=T, heads=H, key_dim=K,
        value_dim=V, num_seqs=num_seqs, features=frozenset(features), ndims=tuple(ndims.items()),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from tops_core import bench

    shape = _parse_shape(args.shape)
    dtype = args.dtype or bench.default_dtype(platform_of([]))
    features = _parse_list(args.with_features) if args.with_features is not None else bench.DEFAULT_FEATURES[args.op]
    case = bench.workload(args.op, shape, dtype, features)
    names = _parse_list(",".join(args.impl))
    print(bench.format_report(bench.run(case, names, budget=args.budget)))
    if args.plot:
        bench.plot(case, names, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise SystemExit(f"--shape must be B,T,H,K,V (five positive integers), got {text!r}")
    return shape


def _parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _table(rows: list[tuple[str, ...]], indent: str = "") -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tops", description="Linear-attention kernels: plugins, dispatch decisions and benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True)

    plugins = commands.add_parser("plugins", help="installed plugins, their versions, and quarantined ones with reasons")
    plugins.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of quarantined plugins")
    plugins.set_defaults(run=cmd_plugins)

    listing = commands.add_parser("list", help="implementations and their support matrix")
    listing.add_argument("op", nargs="?", choices=sorted(CONTRACTS))
    listing.set_defaults(run=cmd_list)

    explain = commands.add_parser("explain", help="describe a call and print the dispatcher's decision trace")
    explain.add_argument("op", choices=sorted(CONTRACTS))
    explain.add_argument("--shape", default="2,4096,8,128,128", help="B,T,H,K,V (default: %(default)s)")
    explain.add_argument("--dtype", default="bfloat16", choices=FLOAT_DTYPES)
    explain.add_argument("--with", dest="with_features", default="", metavar="FEATURES",
                         help="comma-separated optional inputs and options, e.g. g_gamma,initial_state,output_final_state")
    explain.add_argument("--ndim", action="append", default=[], metavar="NAME=RANK", help="rank of an input of variable rank (g_gamma: 0 or 1)")
    explain.add_argument("--num-seqs", type=int, default=1, help="number of packed sequences with cu_seqlens")
    explain.add_argument("--platform", default=platform_of([]), choices=PLATFORMS, help="default: this machine's (%(default)s)")
    explain.add_argument("--interpret", action="store_true", help="interpret mode: accept TPU kernels off TPU")
    explain.add_argument("--force", metavar="IMPL", help="force an implementation, e.g. xla.chunk")
    explain.add_argument("--deny", action="append", default=[], metavar="PATTERN", help="never select these implementations")
    explain.add_argument("--strict", action="store_true", help="no fallback past the forced or highest-priority implementation")
    explain.set_defaults(run=cmd_explain)

    bench = commands.add_parser("bench", help="benchmark every implementation that supports a workload (the main job)")
    bench.add_argument("op", nargs="?", default="simple_gla", choices=sorted(CONTRACTS))
    bench.add_argument("--shape", default="2,4096,8,128,128", help="B,T,H,K,V (default: %(default)s)")
    bench.add_argument("--dtype", choices=FLOAT_DTYPES, help="default: float32 on cpu, bfloat16 elsewhere")
    bench.add_argument("--with", dest="with_features", metavar="FEATURES",
                       help="comma-separated optional inputs and options (default: g_gamma for simple_gla, use_qk_l2norm for kda)")
    bench.add_argument("--impl", action="append", default=[], metavar="NAME", help="only these implementations (repeatable or comma-separated)")
    bench.add_argument("--plot", metavar="FILE", help="also write a PNG of time against sequence length (needs matplotlib)")
    bench.add_argument("--budget", type=float, default=2.0, help="seconds of timed repeats per measurement (default: %(default)s)")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
