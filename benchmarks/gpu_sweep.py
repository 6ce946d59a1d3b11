"""What benchmarks/gpu_session.sh needs beyond the ``mha-harness`` command line, through the library's own API.

    python benchmarks/gpu_sweep.py names --device gpu [--framework torch|jax] [--available] [--table]
    python benchmarks/gpu_sweep.py prefill --backend NAME ... --seq-lens 1024,4096 --dtype bfloat16 --results DIR
    python benchmarks/gpu_sweep.py decode --backend NAME ... --kv-lens 4096,65536 --q-lens 1,16 --dtype bfloat16 \
        --results DIR

* ``names`` prints registered backend names, one a line, selected by device (``cpu`` or ``gpu``: every non-CPU
  device, torch's ``cuda`` and JAX's ``gpu``), framework and availability; unavailable ones go to stderr with
  the registry's reason; ``--table`` prints name, framework and yes/no for every one instead.
* ``prefill`` is ``mha-harness bench`` (mha_harness.bench.sweep.run_bench, same JSON, tables and plots) with a
  dtype: the command line sweeps float32 only, and the GPU sweep is bfloat16.
* ``decode`` is the fallback for a ``mha-harness bench`` without ``--workload decode``: Tq new queries
  (default 1 and 16) against Tk keys/values, bottom-right causal, each backend's prepared callable timed in
  interleaved repeats (order rotating), median and spread, then one call's peak extra memory with the
  backend's own method. The harness layer projects the whole key/value input on every call (there is no
  projected KV cache in its API), so these figures include 2·Tk·d_model² multiply-adds of K/V projection; the
  JSON says so. Written atomically to DIR/decode/decode.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

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


def _seq_lens(text: str) -> list[int]:
    from mha_harness.cli import _seq_lens as parse
    return parse(text)


def cmd_prefill(args) -> int:
    from mha_harness.bench.sweep import BenchConfig, run_bench
    registry = _registry()
    names = [n for n in args.backend if registry.get(n).available]
    for name in sorted(set(args.backend) - set(names)):
        print(f"not benchmarked: {name}: {registry.get(name).reason_unavailable}", flush=True)
    if not names:
        print("prefill: no available backend to benchmark", flush=True)
        return 1
    run_bench(registry, names, Path(args.results), seq_lens=args.seq_lens, causal=args.causal, repeats=args.repeats,
              backward=args.backward, config=BenchConfig(dtype=args.dtype))
    return 0


def _decode_point(backend, config, attn, tq: int, tk: int):
    """(prepared callable, None) or (None, reason) for one decode shape."""
    from mha_harness.bench.sweep import warm_up
    from mha_harness.contract.api import Unsupported
    from mha_harness.contract.params import make_inputs, make_params
    caps = backend.capabilities
    if config.dtype not in caps.dtypes:
        return None, f"dtype {config.dtype} not declared"
    if "bottom-right" not in caps.causal_alignments:
        return None, "no bottom-right causal mask"
    inputs = make_inputs(attn, config.batch, tq, tk, seed=tk + tq, self_attention=False, causal="bottom-right")
    try:
        fn = backend.load(make_params(attn, seed=0), dtype=config.dtype).prepare(inputs)
        return warm_up(fn, 0.2), None
    except (NotImplementedError, Unsupported) as exc:
        return None, str(exc) or type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - one backend's failure is reported, the sweep goes on
        return None, f"error: {type(exc).__name__}: {str(exc)[:300]}"


def cmd_decode(args) -> int:
    from datetime import datetime, timezone

    from mha_harness.bench.memory import peak_extra_bytes, pin_mmap_threshold
    from mha_harness.bench.sweep import BenchConfig, rotated
    from mha_harness.contract.api import AttentionConfig
    from mha_harness.util.atomic import check_writable, write_json_atomic
    registry = _registry()
    directory = check_writable(Path(args.results) / "decode", "--results")
    config = BenchConfig(dtype=args.dtype)
    attn = AttentionConfig(config.d_model, config.num_heads)
    backends = [registry.get(n).backend for n in args.backend if registry.get(n).available]
    start = time.perf_counter()
    points = []
    doc = {"schema": "mha-harness/decode-fallback", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "config": {"batch": config.batch, "d_model": config.d_model, "num_heads": config.num_heads,
                      "dtype": config.dtype, "causal": "bottom-right"},
           "note": "each call projects the whole key/value input (2*Tk*d_model^2 multiply-adds for K and V): "
                   "the harness API has no projected KV cache", "points": points, "complete": False}
    pin_mmap_threshold()
    for tk in sorted(args.kv_lens):
        for tq in sorted(args.q_lens):
            ready = {}
            for backend in backends:
                fn, why = _decode_point(backend, config, attn, tq, tk)
                point = {"backend": backend.name, "tq": tq, "tk": tk, "times_s": [], "skipped": why}
                points.append(point)
                if fn is not None:
                    ready[backend.name] = (backend, fn, point)
            for r in range(args.repeats):
                for name in rotated(list(ready), r):
                    backend, fn, point = ready[name]
                    if point["skipped"]:
                        continue
                    try:
                        t0 = time.perf_counter()
                        fn()
                        point["times_s"].append(time.perf_counter() - t0)
                    except Exception as exc:  # noqa: BLE001
                        point["skipped"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            for backend, fn, point in ready.values():
                if point["skipped"] or not point["times_s"]:
                    continue
                times = point["times_s"]
                point.update(median_s=statistics.median(times), spread=round(max(times) / min(times), 3))
                point["memory_method"] = backend.memory_method
                try:
                    point["peak_extra_bytes"] = peak_extra_bytes(fn, backend.memory_method)
                except Exception as exc:  # noqa: BLE001
                    point["memory_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  decode Tq={tq:<3} Tk={tk:<6} {point['backend']:<26} {point['median_s'] * 1e3:9.3f} ms "
                      f"(spread {point['spread']:.2f})", flush=True)
            for point in points:
                if point["tk"] == tk and point["tq"] == tq and point["skipped"]:
                    print(f"  decode Tq={tq:<3} Tk={tk:<6} {point['backend']:<26} skipped: {point['skipped'][:100]}",
                          flush=True)
            doc["seconds"] = round(time.perf_counter() - start, 1)
            write_json_atomic(directory / "decode.json", doc)  # every finished shape is on disk
    doc["complete"] = True
    write_json_atomic(directory / "decode.json", doc)
    print(f"  json: {directory / 'decode.json'} ({doc['seconds']} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_sweep.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("names")
    p.add_argument("--device", choices=("cpu", "gpu"), required=True)
    p.add_argument("--framework", choices=("torch", "jax", "other"))
    p.add_argument("--available", action="store_true")
    p.add_argument("--table", action="store_true", help="name, framework, available (yes/no), tab-separated")
    for name in ("prefill", "decode"):
        p = sub.add_parser(name)
        p.add_argument("--backend", action="append", default=[], required=True)
        p.add_argument("--dtype", default="bfloat16", choices=("float32", "float64", "bfloat16", "float16"))
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--results", required=True)
    p = sub.choices["prefill"]
    p.add_argument("--seq-lens", type=_seq_lens, required=True)
    p.add_argument("--causal", choices=("off", "on", "both"), default="off")
    p.add_argument("--backward", action="store_true")
    p = sub.choices["decode"]
    p.add_argument("--kv-lens", type=_seq_lens, required=True)
    p.add_argument("--q-lens", type=_seq_lens, default=[1, 16])
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return {"names": cmd_names, "prefill": cmd_prefill, "decode": cmd_decode}[args.command](args)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # results are on disk (atomic writes): skip torch's and XLA's slow interpreter teardown
