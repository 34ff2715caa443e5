"""`python -m tapserve` and `torchrun ... -m tapserve`: launch.py's command line."""

import sys

from tapserve.launch import main

if __name__ == "__main__":  # (run by -m; importing it starts nothing)
    sys.exit(main())
