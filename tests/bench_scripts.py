"""A script of ``bench/`` imported as a module (``bench`` is no package), for the tests of its pure parts."""

import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name: str):
    """``bench/<name>.py`` as the module ``bench_<name>`` (registered in ``sys.modules`` for its dataclasses)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(REPO, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod
