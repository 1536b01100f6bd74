import sys

from scratchlm.cli import main

if __name__ == "__main__":  # spawned processes (TP/PP workers) import this module without running it
    sys.exit(main())
