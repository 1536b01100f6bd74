"""The worker torchrun starts in each network namespace (tests/fold/test_run.py): the hybrid, rank 0's report."""

import json
import sys

from scratchlm.fold.run import run_hybrid

if __name__ == "__main__":
    report = run_hybrid(sys.argv[1:])
    if report is not None:
        print("NETNS_RESULT " + json.dumps(report), flush=True)
