"""Package faces that load on first use: a package's ``__init__`` names what it offers and from
which of its modules, and each module is imported when one of its names is first asked for.

Why: importing any module of a package runs the package's ``__init__`` first. An ``__init__``
that imported every module would make its plain, torch-free modules (the ViT's argument record,
the engine x feature rule, the mesh's shape) cost torch's import, which is what reading and
checking a config must not do (``python tools/run_net.py`` answers a mistyped key in well under a
second). With a face, ``from pycls.models import VisionTransformer`` still works as it always did,
and ``import pycls.models.vit.args`` costs that module alone.

    install_face(__name__, {"anynet": ["AnyNet", "anynet_complexity"], ...})

A name a face exports keeps its meaning when the import system later binds a submodule of the
same name (``pycls.models.resnet`` is the zoo function, as it always was, not the module).
``tests/test_layers.py`` reads these tables as imports of the package.
"""

import importlib
import sys
import types


class _Face(types.ModuleType):
    """A package whose exported names are looked up in their modules on first use."""

    _exports: dict  # name -> the submodule (relative) that defines it

    def __getattr__(self, name):
        exports = type(self)._exports
        if name in exports:
            value = getattr(importlib.import_module(_absolute(self.__name__, exports[name])), name)
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
            return  # the import system binding a submodule over an exported name: keep the name
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(type(self)._exports))


def _absolute(package, module):
    return module if module.startswith("pycls.") else f"{package}.{module}"


def install_face(package, modules):
    """Makes ``package`` (its ``__name__``) a face for ``modules``: {module: [names]}, each module
    relative to the package (or a whole ``pycls.`` name). Sets ``__all__`` to every name."""
    exports = {name: module for module, names in modules.items() for name in names}
    face = sys.modules[package]
    face.__class__ = type("Face", (_Face,), {"_exports": exports})
    face.__all__ = sorted(exports)
