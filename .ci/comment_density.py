"""Fails when a package's comment-and-docstring lines exceed MAX_RATIO of its code lines.

python .ci/comment_density.py            # every package; exit 1 naming those over
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

MAX_RATIO = 0.15
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tapserve": sorted(p.name for p in ROOT.glob("*.py")),  # the root modules, whatever they are
    "api": ["api"],
    "coordinator": ["coordinator"],
    "model": ["model"],
    "ranks": ["ranks"],
    "cuda_graphs": ["cuda_graphs"],
    "bench": ["bench"],
}
LAYOUT = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def count(path: Path) -> tuple[int, int]:
    """(comment-or-docstring lines, code lines) of one file; a line of code with a trailing
    comment counts as code, as cloc counts it."""
    source = path.read_text(encoding="utf-8")
    docstrings = docstring_lines(ast.parse(source))
    comments: set[int] = set()
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in LAYOUT:
            code.update(range(tok.start[0], tok.end[0] + 1))
    code -= docstrings
    return len(docstrings | (comments - code)), len(code)


def package_ratio(entries: list[str]) -> tuple[int, int]:
    files = []
    for entry in entries:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    totals = [count(f) for f in files]
    return sum(p for p, _ in totals), sum(c for _, c in totals)


def main() -> int:
    over = []
    for name, entries in PACKAGES.items():
        prose, code = package_ratio(entries)
        ratio = prose / max(code, 1)
        print(f"{name:12s} {prose:5d} comment/docstring lines, {code:5d} code lines: {ratio:.3f}")
        if ratio > MAX_RATIO:
            over.append(name)
    if over:
        print(f"over {MAX_RATIO}: {', '.join(over)}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
