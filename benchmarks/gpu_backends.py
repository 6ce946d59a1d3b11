"""Registered backends by device and framework, for benchmarks/gpu_session.sh.

    python benchmarks/gpu_backends.py --device gpu [--framework torch|jax|other] [--available] [--table]

Prints backend names one a line, selected by device (``cpu``, or ``gpu``: every non-CPU device, torch's ``cuda`` and
JAX's ``gpu``), framework and availability; unavailable ones also go to stderr with the registry's reason.
``--table`` prints name, framework and yes/no (available) for every selected one instead.
"""
from __future__ import annotations

import argparse
import os
import sys

GPU_DEVICES_NOT = ("cpu",)


def _registry():
    from mha_harness.registry import load_registry
    return load_registry()


def _framework(backend) -> str:
    module = type(backend).__module__
    return "jax" if ("jax" in module or "flax" in module) else "torch" if "torch" in module else "other"


def cmd_names(args) -> int:
    registry = _registry()
    for entry in registry.entries.values():
        backend = entry.backend
        if backend is None:
            continue
        on_gpu = any(d not in GPU_DEVICES_NOT for d in backend.capabilities.devices)
        if (args.device == "gpu") != on_gpu:
            continue
        if args.framework and _framework(backend) != args.framework:
            continue
        reason = entry.reason_unavailable
        if reason:
            print(f"unavailable: {entry.name}: {reason}", file=sys.stderr)
        if args.table:
            print(f"{entry.name}\t{_framework(backend)}\t{'no' if reason else 'yes'}")
        elif not (args.available and reason):
            print(entry.name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_backends.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), required=True)
    parser.add_argument("--framework", choices=("torch", "jax", "other"))
    parser.add_argument("--available", action="store_true")
    parser.add_argument("--table", action="store_true", help="name, framework, available (yes/no), tab-separated")
    return parser


def main(argv=None) -> int:
    return cmd_names(build_parser().parse_args(argv))


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip torch's and XLA's slow interpreter teardown
