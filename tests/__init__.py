"""The test suite. Importing it binds `tapserve` to this checkout, in pytest and in every
process that imports a test module (multiprocessing's spawned children too)."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))
