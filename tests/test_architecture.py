"""The architecture holds: DESIGN.md's layers (imports point down only), analysis/ and telemetry/
import without torch, and the style floors (no function over 80 lines outside kernels/, no module
over 400 lines, an import inside a function only with its reason written beside it).

The layers are import-linter contracts in pyproject.toml ([tool.importlinter]); this runs them, so a
new upward import fails the suite. Each failure lists every offender as file:line.
"""

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "servescope"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
# kernels/ holds straight-line numeric code (Triton kernels, the extension's entry points), which
# is clearer whole than cut at an arbitrary length: the function limit does not apply there
FUNCTION_LIMIT_EXEMPT = (SRC / "kernels",)
# comment text that is a tool pragma, not a reason
_PRAGMA = re.compile(r"(noqa\b(:\s*[\w, ]+)?|type:\s*ignore(\[[^\]]*\])?|pragma:?\s*\S+|pylint:\s*\S+|fmt:\s*\S+)")


def _modules():
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _lint_imports() -> str:
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]')")
        exe = Path(found)
    return str(exe)


def test_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts: the layers, and the torch-free packages."""
    r = subprocess.run([_lint_imports(), str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = r.stdout + r.stderr
    broken = report[report.find("Broken contracts"):] if "Broken contracts" in report else report
    assert r.returncode == 0, f"import contracts broken (lint-imports exit {r.returncode}):\n{broken}"


def test_analysis_and_telemetry_import_without_torch():
    """Importing them (and the simulator) loads no torch: the probe imports it inside its functions only."""
    code = ("import sys, servescope.analysis, servescope.telemetry, servescope.sim.run, servescope.sim.disagg; "
            "print(' '.join(m for m in ('torch', 'servescope.engine') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"importing servescope.analysis/telemetry imported: {r.stdout.strip()}"


def test_no_function_over_80_lines_outside_kernels():
    long = []
    for path in _modules():
        if any(path.is_relative_to(d) for d in FUNCTION_LIMIT_EXEMPT):
            continue
        for fn in _functions(ast.parse(path.read_text(), str(path))):
            n = fn.end_lineno - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                long.append(f"{_rel(path)}:{fn.lineno} {fn.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_module_over_400_lines():
    big = [f"{_rel(p)}: {n} lines" for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(big)


def _reason_lines(source: str) -> set:
    """Line numbers that carry a comment saying something beyond a tool pragma."""
    out = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and _PRAGMA.sub("", tok.string.lstrip("#")).strip(" #:,"):
            out.add(tok.start[0])
    return out


def _comment_only_lines(source: str) -> set:
    return {i for i, line in enumerate(source.splitlines(), 1) if line.strip().startswith("#")}


def _own_imports(fn) -> list:
    """The import statements in fn's body, not those of the functions nested in it, in line order."""
    found, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def unexplained_function_imports(path: Path) -> list:
    """Imports inside a function with no reason beside them: a comment on the statement's lines or on
    the line above. An import right below another explained one (blank lines between them allowed)
    shares its reason, so a group of lazy imports needs one comment."""
    source = path.read_text()
    lines = source.splitlines()
    reasons, comment_only = _reason_lines(source), _comment_only_lines(source)
    out = []
    for fn in _functions(ast.parse(source, str(path))):
        explained_ends = set()  # end lines of this function's explained import statements
        for node in _own_imports(fn):
            own = any(i in reasons for i in range(node.lineno, node.end_lineno + 1))
            above = node.lineno - 1
            prev = above
            while prev > 0 and not lines[prev - 1].strip():
                prev -= 1
            if own or (above in reasons and above in comment_only) or prev in explained_ends:
                explained_ends.add(node.end_lineno)
            else:
                out.append((node.lineno, f"{_rel(path)}:{node.lineno} in {fn.name}(): {lines[node.lineno - 1].strip()}"))
    return [text for _, text in sorted(out)]


def test_imports_inside_functions_say_why():
    bad = [line for p in _modules() for line in unexplained_function_imports(p)]
    assert not bad, ("imports inside functions without a reason beside them (hoist them to the top of the "
                     "module, or say why not: start-up time measured, a true cycle):\n" + "\n".join(bad))
