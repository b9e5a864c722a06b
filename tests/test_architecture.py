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


def test_ruff_lint_passes():
    """[tool.ruff] in pyproject.toml: the line length, unused and undefined names, over src, tests and
    benchmarks."""
    exe = Path(sys.executable).parent / "ruff"
    found = str(exe) if exe.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff not found: install the test extra (pip install -e '.[test]')")
    r = subprocess.run([found, "check", "--no-cache", "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"ruff check failed:\n{r.stdout[-8000:]}{r.stderr[-2000:]}"


DATE_IN_COMMENT = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _comments_and_docstrings(path: Path):
    """(line, text) of every comment and docstring of a Python file, or every // or /* comment line of
    a C++ one."""
    source = path.read_text()
    if path.suffix in (".h", ".cpp"):
        for i, line in enumerate(source.splitlines(), 1):
            if "//" in line or line.lstrip().startswith(("/*", "*")):
                yield i, line
        return
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc


def test_no_comment_carries_a_date():
    """Comments say why; measured figures and their dates live in docs/BENCHMARKS.md (a dated figure in
    a comment goes stale while the code it explains stays)."""
    files = _modules() + sorted(p for ext in ("*.h", "*.cpp") for p in SRC.rglob(ext))
    bad = [f"{_rel(p)}:{line}: {DATE_IN_COMMENT.search(text).group()}" for p in files
           for line, text in _comments_and_docstrings(p) if DATE_IN_COMMENT.search(text)]
    assert not bad, "comments with a date (move the figure to docs/BENCHMARKS.md):\n" + "\n".join(bad)


def import_cycles() -> list:
    """The strongly connected components of more than one module in servescope's import graph (every
    import counted: at module level, inside functions, under TYPE_CHECKING), each as sorted names."""
    grimp = pytest.importorskip("grimp")  # import-linter's graph library (the test extra)
    graph = grimp.build_graph("servescope", exclude_type_checking_imports=False)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):  # Tarjan, iterative (the graph is deeper than Python's recursion limit allows)
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(edges.get(nxt, ()))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle_anywhere_in_src():
    """No module of servescope reaches itself through imports, lazy ones included: a circle that a
    function-level import hides is still a circle (the layer contracts cannot see those inside a layer)."""
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


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
                where = f"{_rel(path)}:{node.lineno} in {fn.name}()"
                out.append((node.lineno, f"{where}: {lines[node.lineno - 1].strip()}"))
    return [text for _, text in sorted(out)]


def test_imports_inside_functions_say_why():
    bad = [line for p in _modules() for line in unexplained_function_imports(p)]
    assert not bad, ("imports inside functions without a reason beside them (hoist them to the top of the "
                     "module, or say why not: start-up time measured, a true cycle):\n" + "\n".join(bad))
