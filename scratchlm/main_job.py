"""`make run`: the main job, `scratchlm serve` on the default model.

While a layer of the stack has not landed yet, this runs the most complete job that exists and
says so, instead of pretending.
"""

from __future__ import annotations

import sys

from scratchlm.cli import SUBCOMMANDS, _load, main

# The main job first, then the fallbacks, most complete first.
PLAN = [
    ("serve", []),
    ("chat", []),
    ("generate", ["--max-tokens", "64", "Once upon a time"]),
]


def run(extra: list[str]) -> int:
    for name, default_args in PLAN:
        if _load(name) is None:
            print(f"[scratchlm] `{name}` has not landed yet ({SUBCOMMANDS[name].issue}).", file=sys.stderr)
            continue
        if name != "serve":
            print(f"[scratchlm] running the most complete main job that exists: scratchlm {name}", file=sys.stderr)
        return main([name, *(extra or default_args)])
    print("[scratchlm] no runnable main job has landed yet; `make test` runs the test suite.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
