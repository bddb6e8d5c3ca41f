"""Graded exercises: `flashlab.check(name, fn)` in a notebook, `python -m flashlab grade` on the command line.

Every module in this package other than the machinery (core, attention, cli, notebook) holds the checkers
of one or more lessons and registers them with `@exercise(...)` (see core.py); it is imported here, so
adding an exercise is one checker function with its hint in such a module.
"""
import importlib
import pkgutil

from .core import EXERCISES, RESULTS, Result, check, exercise, tolerance

_MACHINERY = {"core", "attention", "cli", "notebook", "simcheck"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _MACHINERY:
        importlib.import_module(f".{_module.name}", __name__)

__all__ = ["check", "exercise", "tolerance", "EXERCISES", "RESULTS", "Result"]
