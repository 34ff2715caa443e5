"""`python -m tapserve` and `torchrun ... -m tapserve`: launch.py's command line."""

import sys

from tapserve.launch import main

sys.exit(main())
