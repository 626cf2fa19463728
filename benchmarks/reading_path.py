#!/usr/bin/env python3
"""What a reader must read to follow one epoch of the quickstart: the modules and functions of
pycls that run, in the order they first run, measured under coverage.

The README's quickstart (configs/quickstart.yaml) is run for one epoch, exactly as
``tools/run_net.py`` runs it, in a child process under coverage.py (which lines ran) and a
profile hook (in which order functions are first called). A function *ran* when a line of its
own body ran (not only its ``def``, which runs at import); its *lines* are its source lines,
``def`` to its last line, less the functions nested in it (counted on their own when they ran).

    python benchmarks/reading_path.py                      # the figures and the path, printed
    python benchmarks/reading_path.py --write docs/reading_pycls.md   # the page's table rewritten

The page's generated part lies between its two ``reading-path`` markers; the text around it is
kept. ``tests/docs/test_reading_page.py`` runs the same measurement and holds the page to it.
"""

import argparse
import ast
import json
import os
import runpy
import subprocess
import sys
import tempfile
from collections import defaultdict

import coverage  # pip install -e ".[dev]"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pycls")
RUN_NET = os.path.join(ROOT, "tools", "run_net.py")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
START, END = "<!-- reading-path:start -->", "<!-- reading-path:end -->"


def quickstart_argv(out_dir):
    """run_net.py's command line for one epoch of the README's quickstart into ``out_dir``."""
    return ["--mode", "train", "--cfg", QUICKSTART, "OPTIM.MAX_EPOCH", "1", "OUT_DIR", out_dir]


def trace(result_path, out_dir):
    """(In the child) run the quickstart's epoch under coverage and a profile hook; write which
    lines of pycls ran and the order in which its functions were first called."""
    first_calls = {}  # (file, first line of the code object) -> call order

    def on_call(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE):
            first_calls.setdefault((code.co_filename, code.co_firstlineno), len(first_calls))

    cov = coverage.Coverage(source=[PACKAGE], data_file=None, branch=False)
    cov.start()
    sys.setprofile(on_call)
    sys.argv = [RUN_NET, *quickstart_argv(out_dir)]
    try:
        runpy.run_path(RUN_NET, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    finally:
        sys.setprofile(None)
        cov.stop()
    data = cov.get_data()
    imported = sorted(m.__file__ for m in list(sys.modules.values()) if _in_package(m))
    lines = {path: sorted(data.lines(path) or ()) for path in data.measured_files()}
    order = [[path, line, rank] for (path, line), rank in first_calls.items()]
    with open(result_path, "w") as f:
        json.dump({"lines": lines, "order": order, "imported": imported}, f)


def _in_package(module):
    path = getattr(module, "__file__", None) or ""
    return path.startswith(PACKAGE) and path.endswith(".py")


def measure(work_dir=None, timeout=600):
    """The quickstart epoch's path: ``{"modules": [(module, [(function, lines), ...]), ...] in
    the order they first run, "lines": total function lines, "functions": count, "statements":
    executed lines inside those functions, "imported": modules imported}``."""
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        result = os.path.join(tmp, "trace.json")
        env = {**os.environ, "PYCLS_CACHE_DIR": os.path.join(tmp, "cache")}
        cmd = [sys.executable, os.path.abspath(__file__), "--trace", result, os.path.join(tmp, "q")]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"the quickstart epoch failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        with open(result) as f:
            traced = json.load(f)
    return summarize(traced)


def summarize(traced):
    """The traced lines and call order folded into functions and modules (see ``measure``)."""
    rank = {(path, line): r for path, line, r in traced["order"]}
    ran, statements = [], 0
    for path, executed in traced["lines"].items():
        for function in functions_of(path):
            body = function["body"] & set(executed)
            if body:
                first = min(rank.get((path, line), len(rank)) for line in function["starts"])
                ran.append((first, module_name(path), function["name"], function["lines"]))
                statements += len(body)
    by_module, first_of = defaultdict(list), {}
    for first, module, name, lines in sorted(ran):
        by_module[module].append((name, lines))
        first_of.setdefault(module, first)
    modules = [(m, by_module[m]) for m in sorted(by_module, key=first_of.get)]
    return {
        "modules": modules,
        "lines": sum(lines for *_, lines in ran),
        "functions": len(ran),
        "statements": statements,
        "imported": len(traced["imported"]),
    }


def functions_of(path):
    """Every function of a source file: its qualified name, its own body's lines (nested
    functions and classes left out), the lines its code object may start at (decorators), and
    its own line count."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(_function(child, prefix))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _function(node, prefix):
    nested = [
        n
        for n in ast.walk(node)
        if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    inner = set()
    for n in nested:
        inner.update(range(_start(n), n.end_lineno + 1))
    own = set(range(node.body[0].lineno, node.end_lineno + 1)) - inner
    starts = {_start(node), node.lineno}
    span = node.end_lineno - _start(node) + 1
    outermost = [n for n in nested if not any(n is not o and _inside(n, o) for o in nested)]
    lines = span - sum(n.end_lineno - _start(n) + 1 for n in outermost)
    return {"name": prefix + node.name, "body": own, "starts": starts, "lines": lines}


def _start(node):
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def _inside(node, outer):
    return _start(outer) <= _start(node) and node.end_lineno <= outer.end_lineno


def module_name(path):
    """``pycls/core/trainer.py`` -> ``pycls.core.trainer`` (a package's face: the package)."""
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def page_modules(text):
    """The modules the page's generated table names, in its order."""
    table = text.split(START, 1)[1].split(END, 1)[0]
    return [
        row.split("|")[2].strip().strip("`") for row in table.splitlines() if row.startswith("| ")
    ][1:]


def table(path):
    """The page's generated part for a measured path."""
    rows = [
        START,
        "",
        f"Measured: {path['functions']} functions in {len(path['modules'])} modules,"
        f" {path['lines']:,} lines of functions ({path['statements']:,} of them executed);"
        f" {path['imported']} modules of pycls imported in all.",
        "",
        "| # | module | functions, in the order they first run (lines) | lines |",
        "|---|--------|------------------------------------------------|-------|",
    ]
    for i, (module, functions) in enumerate(path["modules"], 1):
        names = ", ".join(f"`{name}` ({lines})" for name, lines in functions)
        rows.append(f"| {i} | `{module}` | {names} | {sum(n for _, n in functions)} |")
    return "\n".join([*rows, "", END])


def rewrite(page_path, path):
    """Replace the page's generated part with the measured path."""
    with open(page_path) as f:
        text = f.read()
    head, rest = text.split(START, 1)
    with open(page_path, "w") as f:
        f.write(head + table(path) + rest.split(END, 1)[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="PAGE", help="rewrite PAGE's generated table")
    parser.add_argument("--trace", nargs=2, metavar=("RESULT", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trace:
        return trace(*args.trace)
    path = measure()
    if args.write:
        rewrite(args.write, path)
    print(table(path))


if __name__ == "__main__":
    main()
