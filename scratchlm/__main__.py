import sys

from scratchlm.cli import main

sys.exit(main())
