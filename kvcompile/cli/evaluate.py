"""`kvcompile eval [ARGS]`: the quality harness, benchmarks/quality/quality.py `main(argv)`.

Its arguments pass through (`kvcompile eval --suite ppl --quick`). With --json the harness's
own printout goes to stderr and stdout gets one JSON object: the exit code and the results file
(benchmarks/quality/quality_results.json) the harness keeps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys

from kvcompile.cli.benchmarks import benchmarks_dir, split_own_flags
from kvcompile.cli.common import EXIT_UNAVAILABLE, CLIError, Result


def run(args) -> Result:
    rest = split_own_flags(args, list(args.args or []))
    folder = benchmarks_dir()
    path = os.path.join(folder, "quality", "quality.py")
    if not os.path.isfile(path):
        raise CLIError(f"the quality harness {path} is missing",
                       hint="update your checkout (benchmarks/quality/quality.py defines "
                            "main(argv))",
                       code=EXIT_UNAVAILABLE)
    main = _load_main(path)
    sink = sys.stderr if getattr(args, "json", False) else sys.stdout
    with contextlib.redirect_stdout(sink):
        try:
            rc = main(rest)
        except SystemExit as e:  # the harness's own argparse: --help or a bad option
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    rc = int(rc or 0)
    results = os.path.join(folder, "quality", "quality_results.json")
    payload = {"harness": path, "argv": rest, "exit_code": rc,
               "results_file": results if os.path.isfile(results) else None}
    if payload["results_file"]:
        with open(results) as f:
            payload["results"] = json.load(f)
    return Result(payload, "", rc)


def _load_main(path: str):
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the harness imports its siblings (quality_data, ...)
    spec = importlib.util.spec_from_file_location("kvcompile_quality_harness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if not callable(main):
        raise CLIError(f"{path} has no main(argv)", hint="update your checkout",
                       code=EXIT_UNAVAILABLE)
    return main
