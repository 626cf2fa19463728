"""Package faces that load on first use, for the packages a torch-free read passes through.

Importing any module of a package runs the package's ``__init__`` first. An ``__init__`` that
imported every module would make its plain, torch-free modules (the ViT's argument record, the
engine x feature rule, the mesh's shape) cost torch's import, which is what reading and checking
a config must not do (``python tools/run_net.py`` answers a mistyped key in a fraction of a
second). Such a package names what it offers as plain imports under ``if TYPE_CHECKING:``, which
editors, type checkers and import analysis (``tests/test_layers.py``) read as any import, and
``install_face(__name__)`` makes each of those names import its module when first asked for:

    if TYPE_CHECKING:  # the face: each name imports its module on first use (pycls.package_faces)
        from pycls.models.cnn.anynet import AnyNet, anynet_complexity

    install_face(__name__)

``from pycls.models import AnyNet`` works as an eager import would, and ``import
pycls.models.vit.args`` costs that module alone. A package no torch-free read enters imports its
modules eagerly instead (``pycls.core.builders``).

A name a face offers keeps its meaning when the import system later binds a submodule of the
same name (``pycls.models.resnet`` is the zoo function, as upstream's is, not the shim module).
"""

import ast
import importlib
import sys
import types


class _Face(types.ModuleType):
    """A package whose offered names are looked up in their modules on first use."""

    _exports: dict  # name -> the module (absolute) that defines it

    def __getattr__(self, name):
        exports = type(self)._exports
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            object.__setattr__(self, name, value)  # cached: found directly from now on
            return value
        try:  # a submodule asked for as an attribute, as an eager face would have bound it
            return importlib.import_module(f"{self.__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{self.__name__}.{name}":
                raise
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in type(self)._exports:
            return  # the import system binding a submodule over an offered name: keep the name
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(type(self)._exports))


def _is_type_checking(test) -> bool:
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == (
        "TYPE_CHECKING"
    )


def face_imports(path: str) -> dict[str, str]:
    """{name: module} of the ``from MODULE import NAME`` lines under the top-level ``if
    TYPE_CHECKING:`` of the ``__init__`` at ``path`` (absolute imports, each name kept)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    exports = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and _is_type_checking(node.test)):
            continue
        for line in node.body:
            if not isinstance(line, ast.ImportFrom) or line.level:
                raise TypeError(f"{path}:{line.lineno}: a face holds `from pycls.X import Y` only")
            for alias in line.names:
                if alias.asname not in (None, alias.name):
                    raise TypeError(f"{path}:{line.lineno}: a face keeps each name ({alias.name})")
                exports[alias.name] = line.module
    return exports


def install_face(package, modules=None):
    """Makes ``package`` (its ``__name__``) a face for the names its ``__init__`` imports under
    ``if TYPE_CHECKING:`` (or, given ``modules``, for a table {module: [names]}, each module
    relative to the package or a whole ``pycls.`` name). Sets ``__all__`` to every name."""
    face = sys.modules[package]
    if modules is None:
        exports = face_imports(face.__file__)
    else:
        exports = {
            name: module if module.startswith("pycls.") else f"{package}.{module}"
            for module, names in modules.items()
            for name in names
        }
    if not exports:
        raise TypeError(f"{face.__file__}: a face with no names (none under `if TYPE_CHECKING:`)")
    face.__class__ = type("Face", (_Face,), {"_exports": exports})
    face.__all__ = sorted(exports)
