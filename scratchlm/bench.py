"""`scratchlm bench NAME`: run benchmarks/NAME.py from the repository (same as
`python -m benchmarks.NAME`). Benchmarks live next to the package in a source checkout."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "benchmarks"


def available() -> list[str]:
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_") and p.stem != "common")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = available()
    parser.add_argument(
        "name",
        nargs="?",
        help="benchmark to run; one of: " + (", ".join(names) if names else "(none found)"),
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args: argparse.Namespace) -> int:
    names = available()
    if not BENCH_DIR.is_dir():
        print(f"error: no benchmarks/ folder next to the package ({BENCH_DIR}); "
              "benchmarks run from a source checkout", file=sys.stderr)
        return 2
    if args.name is None:
        print("available benchmarks:\n  " + "\n  ".join(names))
        return 0
    if args.name not in names:
        print(f"error: unknown benchmark {args.name!r}; expected one of: {', '.join(names)}", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", f"benchmarks.{args.name}", *args.bench_args]
    return subprocess.call(cmd, cwd=REPO_ROOT, env=env)
