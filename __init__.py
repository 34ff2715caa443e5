"""tapserve: an LLM inference engine whose custom output heads run in the generating pass."""

from pathlib import Path

__version__ = "0.1.0"
ROOT = Path(__file__).resolve().parent


def checkout_entry(relative: str) -> list[str]:
    """The argv prefix that runs this tree's file `relative` in a child process: by file path,
    with the script's folder kept off sys.path (-P), so the child imports this same tree."""
    import sys

    return [sys.executable, "-P", str(ROOT / relative)]
