"""Binds the name `tapserve` to the folder this file is in, so that a script run from a
checkout (launch.py, api/server.py as the API process, bench/*.py, the tests) imports this
tree, whether or not a copy of tapserve is installed. Run it with runpy.run_path."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
loaded = sys.modules.get("tapserve")
if loaded is None or Path(loaded.__path__[0]).resolve() != ROOT:
    spec = importlib.util.spec_from_file_location(
        "tapserve", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["tapserve"] = package
    spec.loader.exec_module(package)
