"""The house rules, read from the source: every import of pycls points down the layer order, no
module takes part in a circle, and only optional packages are imported inside functions.

The layer order (lowest first) is the README's "Layout" section. A module may import modules of
its own layer or of lower ones; the test names the offending import and the rule it breaks.
"""

import ast
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT as REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)

# Lowest first. A module belongs to the first layer one of whose prefixes it equals or extends
# ("pycls" alone is the package's own __init__, which holds only the version).
LAYERS = [
    (
        "leaves",
        [
            "pycls.errors",
            "pycls.signals",
            "pycls.yaml_keys",
            "pycls.package_faces",
            "pycls.options",
            "pycls.atomic_files",
            "pycls",
        ],
    ),
    ("models", ["pycls.models"]),
    ("distributed", ["pycls.distributed"]),
    ("checkpoint", ["pycls.checkpoint"]),
    ("datasets", ["pycls.datasets"]),
    ("engines", ["pycls.engines"]),
    ("optim", ["pycls.optim"]),
    ("config", ["pycls.config"]),
    ("core", ["pycls.core"]),
    ("sweep", ["pycls.sweep"]),
    ("entry points", ["pycls.__main__", "tools", "benchmarks"]),
]

# Third-party packages a function may import where it needs them: optional ones (a user without
# them loses only that feature) and slow ones only one feature uses. Each such import carries a
# comment saying why.
LAZY_ALLOWED = {
    "fairscale",
    "submitit",
    "timm",
    "matplotlib",
    "tqdm",
    "tensorboard",
    "wandb",
    "torchcodec",
    "sklearn",
    # Data where users keep it (pip install pycls-vit[data]): WebDataset tars (webdataset, and
    # braceexpand for shard patterns), parquet (pyarrow), URLs (fsspec; aiohttp under http)
    "webdataset",
    "braceexpand",
    "pyarrow",
    "fsspec",
    "aiohttp",
    # AMP.FLOAT8's float8 linear layers (pycls.engines.float8) and its launch check: an optional
    # package (the extra pycls-vit[float8]) that only a float8 run needs
    "torchao",
    # OPTIM.OPTIMIZER schedulefree_adamw (the extra pycls-vit[schedulefree]): only its runs need it
    "schedulefree",
}


# torch's TensorBoard writer is the optional tensorboard package behind a torch name
OPTIONAL_UNDER_TORCH = {"torch.utils.tensorboard": "tensorboard"}


def _module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources():
    files = sorted((ROOT / "pycls").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    return {_module_name(p): p for p in files}


SOURCES = _sources()


def layer_of(module):
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p != "pycls" and module.startswith(p + ".")) for p in prefixes):
            return index
    return None


def _resolve(importer, node, is_package):
    """The pycls modules an import statement names (a ``from X import name`` names X.name when
    that is a module, else X)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = importer.split(".")
            base = base if is_package else base[:-1]
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        targets = [f"{module}.{a.name}" for a in node.names] + [module]
        targets = [t for t in targets if t in SOURCES] or [module]
        targets = targets[:-1] if len(targets) > 1 and targets[-1] == module else targets
    found = []
    for target in targets:
        if not target.startswith("pycls"):
            continue
        while target not in SOURCES and "." in target:
            target = target.rsplit(".", 1)[0]
        found.append(target)
    return found


def _face_modules(package, node):
    """The modules a package face given as a table loads on first use: ``install_face(__name__,
    {module: names})`` (``pycls.package_faces``), each an import of the package. A face written
    as imports under ``if TYPE_CHECKING:`` is read as any import."""
    if not (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "install_face"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Dict)
    ):
        return []
    modules = [key.value for key in node.args[1].keys]
    return [m if m.startswith("pycls.") else f"{package}.{m}" for m in modules]


def _imports():
    """(importer, target, line, inside a function) for every pycls import."""
    out = []
    for name, path in SOURCES.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, node, path.name == "__init__.py"):
                    if target != name:
                        out.append((name, target, node.lineno, id(node) in in_function))
            for target in _face_modules(name, node):
                out.append((name, target, node.lineno, id(node) in in_function))
    return out


IMPORTS = _imports()


def _where(module, line):
    return f"{SOURCES[module].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    missing = [m for m in SOURCES if layer_of(m) is None]
    assert not missing, (
        f"modules outside the layer order (add them to LAYERS and the README): {missing}"
    )


def test_imports_point_down_the_layers():
    upward = []
    for importer, target, line, _ in IMPORTS:
        a, b = layer_of(importer), layer_of(target)
        if b is not None and a is not None and b > a:
            upward.append(
                f"{_where(importer, line)}: {importer} ({LAYERS[a][0]}) imports {target} "
                f"({LAYERS[b][0]}), a higher layer"
            )
    assert not upward, "imports that point up the layer order:\n" + "\n".join(upward)


# The rooms of pycls.datasets, lowest first: how bytes arrive, what they mean, how samples
# become batches (the README's layout lists them in this order)
DATA_ROOMS = ["pycls.datasets.transport", "pycls.datasets.formats", "pycls.datasets.loading"]


def test_the_data_rooms_import_down_their_order():
    """Within the datasets layer, transport imports neither formats nor loading, and formats does
    not import loading (a reader that reached into the loaders, or a transport that knew a
    format, would fail here)."""

    def room(module):
        found = [k for k, r in enumerate(DATA_ROOMS) if module == r or module.startswith(r + ".")]
        return found[0] if found else None

    upward = [
        f"{_where(importer, line)}: {importer} imports {target}, a room above it"
        for importer, target, line, _ in IMPORTS
        if room(importer) is not None and room(target) is not None and room(target) > room(importer)
    ]
    assert not upward, "\n".join(upward)
    assert {room(m) for m in SOURCES if m.startswith("pycls.datasets.")} == {None, 0, 1, 2}


def test_no_import_circle():
    graph = {}
    for importer, target, line, _ in IMPORTS:
        graph.setdefault(importer, {}).setdefault(target, line)
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                cycles.append(" -> ".join(cycle) + f" (closed at {_where(node, graph[node][nxt])})")
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def _commented(module, line):
    lines = SOURCES[module].read_text().splitlines()
    return "#" in lines[line - 1] or (line >= 2 and lines[line - 2].strip().startswith("#"))


def test_no_pycls_import_inside_a_function():
    """An import tucked into a function hides a circle instead of removing it. The one exception
    is an entry point, which no module of pycls imports (so it is in no circle): it may import
    the command it runs once the torch-free checks of its command line have passed (a mistyped
    key is answered before torch loads), with a comment saying so."""
    imported = {target for _, target, _, _ in IMPORTS}
    entry = [i for i, (name, _) in enumerate(LAYERS) if name == "entry points"]

    def allowed(importer, line):
        return (
            layer_of(importer) in entry and importer not in imported and _commented(importer, line)
        )

    tucked = [
        f"{_where(importer, line)}: {importer} imports {target} inside a function"
        for importer, target, line, inside in IMPORTS
        if inside and not allowed(importer, line)
    ]
    assert not tucked, "\n".join(tucked)


def test_only_optional_packages_are_imported_lazily():
    found = []
    for name, path in SOURCES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    module = node.module or ""
                    tops = [OPTIONAL_UNDER_TORCH.get(module, module.split(".")[0])]
                else:
                    continue
                for top in tops:
                    if top == "pycls":  # pycls's own: test_no_pycls_import_inside_a_function
                        continue
                    commented = "#" in lines[node.lineno - 1] or (
                        node.lineno >= 2 and lines[node.lineno - 2].strip().startswith("#")
                    )
                    if top not in LAZY_ALLOWED:
                        found.append(f"{_where(name, node.lineno)}: {top} imported in a function")
                    elif not commented:
                        found.append(
                            f"{_where(name, node.lineno)}: lazy import of {top} without a "
                            "comment saying why"
                        )
    assert not found, "\n".join(sorted(set(found)))


def test_the_readme_names_every_package_imported_lazily():
    """The README's list of third-party packages imported inside functions is LAZY_ALLOWED."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    start = readme.index("imported inside functions only when")
    listed = readme[start : readme.index(")", start)]
    names = {"sklearn": "scikit-learn"}
    missing = [p for p in sorted(LAZY_ALLOWED) if names.get(p, p) not in listed]
    assert not missing, f"the README's list of lazily imported packages lacks {missing}"


def test_no_comment_cites_an_issue():
    cited = []
    for path in list(SOURCES.values()) + sorted((ROOT / "tests").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "#" in line and _cites_issue(line.split("#", 1)[1]):
                cited.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not cited, "comments should say why, not which issue:\n" + "\n".join(cited)


def _cites_issue(comment):
    return re.search(r"\bissue\s*#?\d+", comment, re.IGNORECASE) is not None


@pytest.mark.parametrize(
    "package", sorted(p.name for p in (ROOT / "pycls").iterdir() if (p / "__init__.py").exists())
)
def test_every_package_says_what_it_is(package):
    init = ROOT / "pycls" / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and doc.strip(), f"pycls/{package}/__init__.py has no docstring saying what it holds"


def test_core_is_at_most_thirty_percent_of_pycls():
    def lines(paths):
        return sum(len(p.read_text().splitlines()) for p in paths)

    total = lines((ROOT / "pycls").rglob("*.py"))
    core = lines((ROOT / "pycls" / "core").rglob("*.py"))
    assert core <= 0.30 * total, f"pycls/core holds {core} of {total} lines ({core / total:.0%})"


# The house mark: a module of the package with more lines than this holds more than one job
MAX_MODULE_LINES = 600
# Modules above the mark while they are split; none may join them
ABOVE_THE_MARK = set()


def test_no_module_is_above_the_house_mark():
    long = {
        name: n
        for name, path in SOURCES.items()
        if name.startswith("pycls") and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    grown = {name: n for name, n in long.items() if name not in ABOVE_THE_MARK}
    assert not grown, f"modules above {MAX_MODULE_LINES} lines (split each by its jobs): {grown}"


def test_the_readme_states_this_layer_order():
    readme = (ROOT / "README.md").read_text()
    order = " -> ".join(name for name, _ in LAYERS)
    assert order in readme, f"the README's Layout section should state the layer order: {order}"


# Module names two modules may share: package entry points, each re-export shim with the
# module it stands in for, and "loading", the room of pycls.datasets that turns samples into
# batches (a package) beside pycls.config.loading (how a config file is read): the code imports
# each with its parent's name (``from pycls.datasets.loading import ...``)
SHARED_NAMES = {"__init__", "__main__", "cli", "loading"}
# Re-export shims: old import paths users rely on (the README documents each), each saying so in
# its docstring. No other module is only imports
SHIMS = {
    "pycls.core.config": "pycls.config",
    "pycls.core.optimizer": "pycls.optim",
    "pycls.models.anynet": "pycls.models.cnn.anynet",
    "pycls.models.regnet": "pycls.models.cnn.regnet",
    "pycls.models.resnet": "pycls.models.cnn.resnet",
    "pycls.models.effnet": "pycls.models.cnn.effnet",
    "pycls.datasets.loader": "pycls.datasets.loading.loader",
    "pycls.datasets.transforms": "pycls.datasets.loading.transforms",
}

# Upstream pycls's modules (github.com/facebookresearch/pycls at 5719de6, pycls/): the only paths
# a shim may stand at; a path only this package ever had moves with a release note instead
# (docs/changing_pycls.md, "Moved in this release")
UPSTREAM_MODULES = {
    *(f"pycls.core.{m}" for m in ("benchmark", "builders", "checkpoint", "config", "distributed")),
    *(f"pycls.core.{m}" for m in ("io", "logging", "meters", "net", "optimizer", "plotting")),
    *(f"pycls.core.{m}" for m in ("timer", "trainer")),
    *(f"pycls.datasets.{m}" for m in ("augment", "cifar10", "imagenet", "loader", "transforms")),
    *(f"pycls.models.{m}" for m in ("anynet", "blocks", "effnet", "model_zoo", "regnet")),
    *(f"pycls.models.{m}" for m in ("resnet", "scaler", "vit")),
    *(f"pycls.sweep.{m}" for m in ("analysis", "config", "htmlbook", "plotting", "random")),
    "pycls.sweep.samplers",
}


def _is_only_imports(path):
    body = ast.parse(path.read_text()).body
    body = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    imports = (ast.Import, ast.ImportFrom)
    names = [n for n in body if not isinstance(n, imports)]
    all_list = [
        n
        for n in names
        if isinstance(n, ast.Assign)
        and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__all__"]
    ]
    return bool(body) and len(names) == len(all_list)


def test_no_two_modules_share_a_name():
    by_name = {}
    for module in SOURCES:
        if module.startswith("pycls.") and module not in SHIMS:
            by_name.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    shared = {
        name: modules
        for name, modules in by_name.items()
        if len(modules) > 1 and name not in SHARED_NAMES
    }
    assert not shared, (
        f"modules that share a name (rename one so the name says what it holds): {shared}"
    )


def test_every_module_that_only_re_exports_is_a_documented_shim():
    shims = [
        m
        for m, path in SOURCES.items()
        if m.startswith("pycls.") and path.name != "__init__.py" and _is_only_imports(path)
    ]
    assert sorted(shims) == sorted(SHIMS), "modules that only re-export other modules' names"
    readme = (ROOT / "README.md").read_text()
    for shim, target in SHIMS.items():
        doc = ast.get_docstring(ast.parse(SOURCES[shim].read_text())) or ""
        assert doc.startswith("Re-export shim"), f"{shim}: its docstring should say it is a shim"
        assert target in doc, f"{shim}: its docstring should name where the code lives ({target})"
        assert shim in readme, f"{shim}: a shim is kept for the users the README tells of it"


def test_shims_stand_only_at_upstream_paths():
    """A re-export shim keeps an upstream user's import working; a path only this package had
    is not kept (its move is in the release note)."""
    fork_only = sorted(set(SHIMS) - UPSTREAM_MODULES)
    assert not fork_only, f"re-export shims at paths upstream pycls never had: {fork_only}"


# The layers that take plain arguments: the config node never reaches them
BELOW_THE_BUILDERS = ("models", "distributed", "checkpoint", "datasets", "engines", "optim")


def _config_sections():
    """The config tree's top-level keys (``_C.MODEL = CfgNode()``, ``_C.DEVICE = "auto"``), as the
    config's sections declare them (pycls/config/sections/), or generate them from a record's
    fields (``pycls.config.records``: the VIT group)."""
    from pycls.config.defaults import DEFAULTS

    found = set(DEFAULTS)
    for path in sorted((ROOT / "pycls" / "config" / "sections").glob("*.py")):
        found |= _top_level_keys(ast.parse(path.read_text()))
    return found


def _top_level_keys(tree):
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "_C"
                ):
                    found.add(target.attr)
    return found


def test_the_config_stops_at_the_builders():
    """Models, launchers, checkpoints, data sets, engines and optimizers get plain arguments or
    small typed settings from pycls.core.builders: no parameter takes a config node and no code
    reads a config key (``x.TRAIN``, ``x.DEVICE``)."""
    sections = _config_sections()
    assert {"MODEL", "TRAIN", "VIT", "DEVICE", "OPTIM"} <= sections
    below = {i for i, (name, _) in enumerate(LAYERS) if name in BELOW_THE_BUILDERS}
    found = []
    for module, path in SOURCES.items():
        if layer_of(module) not in below:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.arg) and node.arg in ("cfg", "config"):
                found.append(f"{_where(module, node.lineno)}: a parameter named {node.arg!r}")
            elif isinstance(node, ast.Attribute) and node.attr in sections:
                found.append(f"{_where(module, node.lineno)}: reads the config key {node.attr}")
    assert not found, "the config node below the builders:\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------------ #
# The config's sections: one owner per key, and checks that say which other keys they read
# ------------------------------------------------------------------------------------------------ #
SECTIONS_DIR = ROOT / "pycls" / "config" / "sections"


def _section_modules():
    """The config's sections (pycls/config/sections/*.py, but for the package face and the
    helpers the sections share): {name: path}."""
    helpers = {"__init__", "key_checks"}
    return {p.stem: p for p in sorted(SECTIONS_DIR.glob("*.py")) if p.stem not in helpers}


def _declared_keys(path):
    """The dotted keys a module declares at its top level: ``_C.NODE.KEY = value``, ``_C.KEY =
    value`` (a ``CfgNode()`` is a group, not a key)."""
    keys = []
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, parts = node.targets[0], []
        while isinstance(target, ast.Attribute):
            parts.append(target.attr)
            target = target.value
        group = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "CfgNode"
        if isinstance(target, ast.Name) and target.id == "_C" and parts and not group:
            keys.append(".".join(reversed(parts)))
    return keys


def _generated_keys(name):
    """The keys a section generates from a settings record's fields (``pycls.config.records``):
    those of its tree that no assignment declares."""
    from pycls.config import sections

    tree = getattr(sections, name)._C
    return sorted(set(_tree_keys(tree)) - set(_declared_keys(_section_modules()[name])))


def _owners():
    """{key: the sections that declare it}: by an assignment in the section's source, or by
    generating it from a record's field."""
    owners = {}
    for name, path in _section_modules().items():
        for key in _declared_keys(path) + _generated_keys(name):
            owners.setdefault(key, []).append(name)
    return owners


def _tree_keys(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _tree_keys(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_every_config_key_is_declared_in_exactly_one_section():
    """A key's default, comment, checks, features and what it becomes live in its section; the
    tree (pycls/config/defaults.py) only assembles them, and no other module of the config
    declares a key."""
    from pycls.config.defaults import DEFAULTS

    owners = _owners()
    twice = {key: names for key, names in owners.items() if len(names) > 1}
    assert not twice, f"keys declared by more than one section: {twice}"
    keys = set(_tree_keys(DEFAULTS))
    assert set(owners) == keys, (
        f"keys of the tree no section declares: {sorted(keys - set(owners))}; declared keys not "
        f"in the tree: {sorted(set(owners) - keys)}"
    )
    config = ROOT / "pycls" / "config"
    elsewhere = {
        str(path.relative_to(ROOT)): _declared_keys(path)
        for path in config.rglob("*.py")
        if _declared_keys(path) and not path.is_relative_to(SECTIONS_DIR)
    }
    assert not elsewhere, f"config keys declared outside pycls/config/sections: {elsewhere}"


def _gates(function):
    """The nodes of ``if <test>: return`` tests: a check that only decides whether it applies."""
    gated = set()
    for node in ast.walk(function):
        if (
            isinstance(node, ast.If)
            and len(node.body) == 1
            and isinstance(node.body[0], ast.Return)
        ):
            gated.update(id(n) for n in ast.walk(node.test))
    return gated


def _keys_read(function, keys):
    """The dotted keys a check reads: ``c.NODE.KEY``, ``v.KEY`` after ``v = c.NODE`` (or
    ``o, v = c.OPTIM, c.VIT``) and ``c.KEY``, outside the tests that only gate the check."""
    if not function.args.args:
        return set()
    cfg = function.args.args[0].arg
    aliases = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) else []
            pairs = list(pairs) if isinstance(value, ast.Tuple) else [(target, value)]
            for name, group in pairs:
                if (
                    isinstance(name, ast.Name)
                    and isinstance(group, ast.Attribute)
                    and getattr(group.value, "id", None) == cfg
                ):
                    aliases[name.id] = group.attr
    gated, read = _gates(function), set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Attribute) or id(node) in gated:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id == cfg:
            read.add(node.attr)
        elif isinstance(base, ast.Name) and base.id in aliases:
            read.add(f"{aliases[base.id]}.{node.attr}")
        elif isinstance(base, ast.Attribute) and getattr(base.value, "id", None) == cfg:
            read.add(f"{base.attr}.{node.attr}")
    return read & keys


def _message_text(function):
    """Every string the check writes (its docstring aside)."""
    doc = ast.get_docstring(function, clean=False)
    return " ".join(
        n.value
        for n in ast.walk(function)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value != doc
    )


def test_a_check_names_the_keys_of_other_sections_it_reads():
    """A section's check (``check``, ``check_*``, ``_check_*``) that reads a key another section
    owns names it (``NODE.KEY``) in its messages: whoever reads the error learns every key the
    refusal depends on, and whoever changes that key finds the check by its name."""
    owners = {key: names[0] for key, names in _owners().items()}
    unnamed, checks = [], 0
    for section, path in _section_modules().items():
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            if not (function.name == "check" or function.name.lstrip("_").startswith("check_")):
                continue
            text, checks = _message_text(function), checks + 1
            for key in sorted(_keys_read(function, set(owners))):
                if owners[key] != section and key not in text:
                    where = f"pycls/config/sections/{section}.py:{function.lineno}"
                    unnamed.append(f"{where}: {function.name} reads {key} ({owners[key]}'s)")
    assert checks > 0, "no checks found in pycls/config/sections"
    assert not unnamed, "checks that read another section's key without naming it:\n" + "\n".join(
        unnamed
    )


# ------------------------------------------------------------------------------------------------ #
# The config floor, and engines that know no model
# ------------------------------------------------------------------------------------------------ #
HEAVY = ("torch", "torchvision")


def _heavy(modules):
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@functools.cache
def _config_read_modules():
    """The modules a process imports to read and check the quickstart config."""
    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = (
        "import sys; from pycls.config import assert_cfg, read_cfg; "
        "assert_cfg(read_cfg(sys.argv[1], ['TRAIN.BATCH_SIZE', '3'])); print(sorted(sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", code, quickstart], capture_output=True, text=True,
                       env=env, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return ast.literal_eval(p.stdout.strip().splitlines()[-1])


def test_reading_and_checking_a_config_imports_no_torch():
    """The config floor: reading a YAML file and checking it imports no torch (nor any pycls
    module that needs it), and tools/run_net.py answers a mistyped key before torch loads."""
    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert _heavy(_config_read_modules()) == []
    run_net = str(ROOT / "tools" / "run_net.py")
    cmd = [sys.executable, "-X", "importtime", run_net, "--mode", "info", "--cfg", quickstart]
    p = subprocess.run([*cmd, "TRAIN.BATCH_SIZ", "3"], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2 and "TRAIN.BATCH_SIZ: unknown config key" in p.stderr, p.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()]
    imported = [m for m in imported if m and not m.startswith("import time")]
    assert "pycls.config.loading" in imported and _heavy(imported) == []


def _eager_statements(tree):
    """The statements a module runs when imported: the top level and what it nests in ``if``,
    ``try`` and ``with``, not function or class bodies nor ``if TYPE_CHECKING:`` (a face's list)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(ast.iter_child_nodes(node))
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node


@functools.cache
def _eager_imports(module):
    """(whether ``module`` itself imports torch or torchvision, the pycls modules importing it
    loads: its packages' ``__init__``s and what it imports eagerly)."""
    loads = {module.rsplit(".", i)[0] for i in range(1, module.count("."))}
    path, heavy = SOURCES[module], False
    for node in _eager_statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            heavy |= bool(_heavy(n for n in names if n and not getattr(node, "level", 0)))
            loads.update(_resolve(module, node, path.name == "__init__.py"))
    return heavy, frozenset(m for m in loads if m in SOURCES and m != module)


def _imports_torch(module):
    """Whether importing ``module`` (a pycls module) loads torch or torchvision: itself, its
    packages' ``__init__``s or any pycls module it imports eagerly, followed to the end."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        heavy, loads = _eager_imports(name)
        if heavy:
            return True
        todo.extend(loads)
    return False


def _lazy_faces():
    """{package: the modules its face loads on first use} of every lazy package face."""
    from pycls.package_faces import face_imports

    faces = {}
    for package, path in SOURCES.items():
        text = path.read_text()
        if path.name != "__init__.py" or "install_face(" not in text:
            continue
        tree = ast.parse(text, str(path))
        table = [m for node in ast.walk(tree) for m in _face_modules(package, node)]
        faces[package] = set(table) | set(face_imports(str(path)).values())
    return faces


def test_a_package_face_is_lazy_only_where_a_torch_free_read_needs_it():
    """A package imports its modules eagerly, as editors and readers expect, unless reading a
    config passes through it (``pycls.package_faces``) and importing what it offers would load
    torch: a lazy face no config read enters, or one whose modules are all torch-free, fails here
    naming the package to make eager (reading a config without torch is held by the test above).
    Caught: ``pycls.core.builders`` made a lazy face; ``pycls.optim``'s face with only its
    torch-free modules offered."""
    read = set(_config_read_modules())
    faces = _lazy_faces()
    assert "pycls.models" in faces and "pycls.config" in faces, sorted(faces)
    unread = [p for p in faces if not any(m.startswith(p + ".") for m in read)]
    assert not unread, f"lazy package faces no torch-free read enters (import eagerly): {unread}"
    free = [p for p, modules in faces.items() if not any(map(_imports_torch, modules))]
    assert not free, f"lazy package faces whose modules need no torch (import eagerly): {free}"


def test_imports_torch_follows_the_imports():
    """The reading behind the rule above: a module that loads torch through another is seen
    (caught: following only a module's own imports), a torch-free one is not."""
    assert _imports_torch("pycls.models.vit.transformer")
    assert _imports_torch("pycls.core.builders")  # through its modules, none imports torch itself
    assert not _imports_torch("pycls.models.vit.args")
    assert not _imports_torch("pycls.config.loading")


# The model families' modules, which the engines reach only through a model's parallel plan
MODEL_FAMILIES = ("pycls.models.vit", "pycls.models.cnn", "pycls.models.zoo")
MODEL_FAMILIES += ("pycls.models.anynet", "pycls.models.regnet", "pycls.models.resnet")
MODEL_FAMILIES += ("pycls.models.effnet",)


def test_the_engines_name_no_model():
    """The engines cut whatever model they hold through its parallel plan
    (``pycls.models.parallel_plans``: the ViT's pipeline cut and tensor plan live beside the ViT),
    so no engine imports a model family (the shims of old paths aside)."""
    found = [
        f"{_where(importer, line)}: {importer} imports {target}"
        for importer, target, line, _ in IMPORTS
        if importer.startswith("pycls.engines") and importer not in SHIMS
        if any(target == m or target.startswith(m + ".") for m in MODEL_FAMILIES)
    ]
    assert not found, "engines that import a model family:\n" + "\n".join(found)
