"""Finding the benchmark scripts (benchmarks/ in a source checkout) for `eval` and `bench`."""

from __future__ import annotations

import os

from kvcompile.cli.common import EXIT_UNAVAILABLE, CLIError

OWN_FLAGS = ("--json", "--debug", "--quiet", "-q", "--dry")


def benchmarks_dir() -> str:
    """$KVCOMPILE_BENCHMARKS, else benchmarks/ next to the kvcompile package (a source checkout
    or an editable install; a wheel does not ship the benchmarks)."""
    env = os.environ.get("KVCOMPILE_BENCHMARKS")
    if env:
        if not os.path.isdir(env):
            raise CLIError(f"KVCOMPILE_BENCHMARKS={env} is not a folder",
                           hint="point it at the benchmarks/ folder of a kvcompile checkout",
                           code=EXIT_UNAVAILABLE)
        return env
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(here, "benchmarks")
    if not os.path.isdir(path):
        raise CLIError("the benchmarks/ folder is not here (kvcompile was installed from a "
                       "wheel, which does not ship it)",
                       hint="run from a source checkout (pip install -e .) or set "
                            "KVCOMPILE_BENCHMARKS=/path/to/kvcompile/benchmarks",
                       code=EXIT_UNAVAILABLE)
    return path


def split_own_flags(args, rest: list[str]) -> list[str]:
    """Flags of ours that argparse left in a REMAINDER go back onto `args`."""
    out = []
    for a in rest:
        if a in OWN_FLAGS:
            name = "quiet" if a == "-q" else a.lstrip("-")
            setattr(args, name, True)
        else:
            out.append(a)
    return out
