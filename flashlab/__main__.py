"""Command line: `python -m flashlab COMMAND`.

    build [--check]        regenerate notebooks/, exercises/, solutions/ from course/
    grade [PATH ...]       grade exercise notebooks (see `python -m flashlab grade --help`)
    doctor                 print the backend, GPU and versions, and run a smoke kernel
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "build":
        from .build import main as build_main

        return build_main(rest)
    if cmd == "grade":
        from .grading.cli import main as grade_main

        return grade_main(rest)
    if cmd == "doctor":
        from .checkup import doctor

        doctor()
        return 0
    print(f"unknown command {cmd!r}; expected one of: build, grade, doctor", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
