"""The `kvcompile` console script.

    kvcompile demo [--kv-dtype fp8_e4m3] [--prompt TEXT]      # SmolLM2-135M, compiled, answers
    kvcompile inspect MODEL [--batch B --context L]          # sites, rewrites, memory plan
    kvcompile inspect MODEL --passes [--pass NAME]           # graph code and diff per pass
    kvcompile inspect MODEL --dot/--svg FILE [--site NAME]   # one site before / after
    kvcompile inspect MODEL --verify                         # eager vs compiled, per layer
    kvcompile eval [ARGS]                                    # benchmarks/quality/quality.py
    kvcompile bench [NAME] [ARGS]                            # benchmarks/bench_NAME.py (CUDA)

Every command takes --json (one JSON object on stdout), --debug (tracebacks), --quiet, and
--log-level. Exit codes: kvcompile/cli/common.py (EXIT_*) and docs/cli.md.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from kvcompile.cli.common import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_MODEL,
    EXIT_RUNTIME,
    EXIT_USAGE,
    CLIError,
    dumps,
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises CLIError (so --json and exit codes stay ours) instead of exiting."""

    def error(self, message):
        raise CLIError(message, hint=f"see `{self.prog} --help`", code=EXIT_USAGE)


def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    d = {"default": argparse.SUPPRESS} if suppress else {}
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout", **d)
    g.add_argument("--debug", action="store_true", help="show tracebacks on errors", **d)
    g.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr", **d)
    g.add_argument("--log-level", metavar="LEVEL",
                   help="show the `kvcompile` logger at LEVEL (DEBUG, INFO, ...) on stderr", **d)


def _model_options(p: argparse.ArgumentParser, kv_default: str) -> None:
    from kvcompile.config import INNER_BACKENDS, KV_DTYPES, PAGE_SIZES

    g = p.add_argument_group("model and cache")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the model runs (auto: CUDA when present)")
    g.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="model dtype (auto: fp32 on the CPU, bf16 on CUDA)")
    g.add_argument("--kv-dtype", default=kv_default, choices=KV_DTYPES,
                   help=f"KV cache storage format (default {kv_default})")
    g.add_argument("--page-size", type=int, default=16, choices=PAGE_SIZES,
                   help="tokens per KV page (default 16)")
    g.add_argument("--max-kv-mib", type=float, default=256.0,
                   help="KV pool budget in MiB (default 256)")
    g.add_argument("--eviction", metavar="POLICY[:k=v,...]", default=None,
                   help="eviction policy, e.g. sink_window:sinks=4,window=1020 | "
                        "h2o:budget=1024,recent=256 | snapkv:budget=1024")
    g.add_argument("--inner", default="auto", choices=("auto",) + INNER_BACKENDS,
                   help="backend for the rest of the graph (auto: inductor on CUDA; on the CPU, "
                        "where inductor's C++ compile takes minutes, eager for demo and "
                        "aot_eager for inspect)")


def build_parser() -> argparse.ArgumentParser:
    from kvcompile.passes.pipeline import PASS_NAMES

    root = _Parser(prog="kvcompile", description="kvcompile: paged, quantized KV cache for any "
                   "PyTorch / Hugging Face model, as a torch.compile backend.",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog="exit codes: 0 ok, 1 internal error, 2 usage, 3 model not found, "
                          "4 verify diverged, 5 unavailable here (CUDA, package), "
                          "6 kvcompile runtime error, 130 interrupted")
    _common(root, suppress=True)
    root.add_argument("--version", action="store_true", help="print the version and exit")
    sub = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser("demo", help="SmolLM2-135M compiled with kvcompile answers a prompt")
    demo.add_argument("--model", default="smollm2", help="model spec (default smollm2)")
    demo.add_argument("--prompt", default=None, help="the question (a default one is used)")
    demo.add_argument("--max-new-tokens", type=int, default=48,
                      help="most tokens in the answer (default 48; greedy, stops at EOS)")
    demo.add_argument("--no-chat-template", action="store_true",
                      help="feed the prompt raw, without the model's chat template")
    _model_options(demo, "fp8_e4m3")
    _common(demo, suppress=True)

    ins = sub.add_parser("inspect", help="what the passes found and did, memory plan, verify",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="MODEL: a local HF directory, a .gguf file, smollm2, "
                                     "tiny-llama | tiny-qwen2 | tiny-mistral | tiny-gpt2, or "
                                     "module:factory")
    ins.add_argument("model", metavar="MODEL",
                     help="smollm2, a Hugging Face directory, a .gguf file, tiny-llama "
                          "(tiny-qwen2, tiny-mistral, tiny-gpt2), or module:factory")
    ins.add_argument("--batch", type=int, default=1, help="memory plan: sequences (default 1)")
    ins.add_argument("--context", type=int, default=None,
                     help="memory plan: tokens per sequence (default: the model's context, at "
                          "most 32768)")
    ins.add_argument("--tp", type=int, default=1, metavar="N",
                     help="memory plan: per rank of N tensor-parallel ranks (default 1)")
    ins.add_argument("--passes", action="store_true",
                     help="print each pass's summary and the graph diff it made")
    ins.add_argument("--pass", dest="stop_pass", metavar="NAME", choices=PASS_NAMES,
                     help=f"stop after this pass ({', '.join(PASS_NAMES)}); implies --passes")
    ins.add_argument("--full", action="store_true",
                     help="with --passes: print the whole graph code before and after")
    ins.add_argument("--graph", type=int, default=None,
                     help="with --passes: only graph N (1 = prefill, 2 = first decode, ...)")
    ins.add_argument("--dot", metavar="FILE", help="write one site before/after as Graphviz DOT")
    ins.add_argument("--svg", metavar="FILE", help="write one site before/after as SVG")
    ins.add_argument("--site", metavar="NAME", help="the site for --dot/--svg (default: the "
                     "first rewritten one)")
    ins.add_argument("--verify", action="store_true",
                     help="run eager and compiled side by side; per-layer error, logits KL")
    ins.add_argument("--prompt", default=None, help="prompt for the trace / --verify")
    ins.add_argument("--prompt-tokens", type=int, default=24,
                     help="length of the random prompt for models without a tokenizer")
    ins.add_argument("--steps", type=int, default=4,
                     help="--verify: decode steps after the prompt (teacher-forced)")
    _model_options(ins, "fp8_e4m3")
    _common(ins, suppress=True)

    ev = sub.add_parser("eval", help="quality harness (benchmarks/quality/quality.py): "
                        "perplexity, passkey; arguments after `eval` go to the harness")
    ev.add_argument("args", nargs=argparse.REMAINDER,
                    help="arguments of benchmarks/quality/quality.py")
    _common(ev, suppress=True)

    be = sub.add_parser("bench", help="speed benchmarks (benchmarks/bench_*.py; need CUDA)")
    be.add_argument("name", nargs="?", help="benchmark: NAME runs benchmarks/bench_NAME.py")
    be.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    be.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    be.add_argument("--dry", action="store_true",
                    help="CPU dry run (KVC_BENCH_DRY=1: tiny shapes, Triton interpreter)")
    _common(be, suppress=True)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    as_json = "--json" in argv
    with warnings.catch_warnings():
        _one_line_warnings()
        return _main(argv, debug, as_json)


def _one_line_warnings() -> None:
    """kvcompile's warnings (a site or model left as it was) as `kvcompile: warning: ...` on
    stderr, without the source line Python adds."""
    from kvcompile.errors import KVCompileWarning

    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, KVCompileWarning):
            print(f"kvcompile: warning: {message}", file=sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def _main(argv: list[str], debug: bool, as_json: bool) -> int:
    try:
        head, tail = _split_passthrough(argv)
        args = build_parser().parse_args(head)
        if tail is not None:
            args.args = tail
        debug = getattr(args, "debug", False) or debug
        as_json = getattr(args, "json", False) or as_json
        if getattr(args, "log_level", None):
            from kvcompile.telemetry import enable_logging

            try:
                enable_logging(args.log_level)
            except ValueError as e:
                raise CLIError(f"--log-level: {e}", "use DEBUG, INFO, WARNING or ERROR") from e
        if args.version:
            from kvcompile import __version__

            print(dumps({"version": __version__}) if as_json else f"kvcompile {__version__}")
            return 0
        if args.command is None:
            raise CLIError("no command given", "kvcompile demo | inspect MODEL | eval | bench; "
                           "see `kvcompile --help`")
        result = _dispatch(args)
        as_json = getattr(args, "json", False) or as_json  # eval / bench: flags after NAME
    except CLIError as e:
        return _fail(e.message, e.hint, e.code, as_json, debug)
    except KeyboardInterrupt:
        return _fail("interrupted", "", EXIT_INTERRUPTED, as_json, debug)
    except Exception as e:  # noqa: BLE001  (every error becomes one line, unless --debug)
        code, hint = _classify(e)
        return _fail(f"{type(e).__name__}: {_first_line(e)}", hint, code, as_json, debug)
    if as_json:
        print(dumps(result.payload))
    elif result.text:
        print(result.text)
    return result.code


_BENCH_OWN = ("--list", "--dry", "--json", "--debug", "--quiet", "-q", "--help", "-h")


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`eval` and `bench NAME` hand every later argument to the harness / benchmark untouched
    (argparse would reject their options); kvcompile's own flags are picked out of that tail by
    the command (cli/benchmarks.py: split_own_flags)."""
    for i, a in enumerate(argv):
        if a.startswith("-"):
            continue
        if a == "eval":
            return argv[:i + 1], argv[i + 1:]
        if a == "bench":
            j = i + 1
            while j < len(argv) and argv[j] in _BENCH_OWN:
                j += 1
            if j < len(argv):
                j += 1  # NAME
            return argv[:j], argv[j:]
        break
    return argv, None


def _dispatch(args):
    if args.command == "demo":
        from kvcompile.cli.demo import run
    elif args.command == "inspect":
        from kvcompile.cli.inspect import run
    elif args.command == "eval":
        from kvcompile.cli.evaluate import run
    else:
        from kvcompile.cli.bench import run
    return run(args)


def _classify(e: Exception) -> tuple[int, str]:
    from kvcompile.errors import KVCompileError, KVConfigError

    if isinstance(e, KVConfigError):
        return EXIT_USAGE, "fix the option named above"
    if isinstance(e, KVCompileError):
        return EXIT_RUNTIME, "the message says what to change; --debug shows where it happened"
    try:
        from kvcompile.models import ModelNotFoundError
    except ImportError:  # pragma: no cover
        ModelNotFoundError = ()  # noqa: N806
    if isinstance(e, ModelNotFoundError):
        return EXIT_MODEL, e.hint
    return EXIT_INTERNAL, "this looks like a bug in kvcompile: rerun with --debug for the " \
                          "traceback and report it"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _fail(message: str, hint: str, code: int, as_json: bool, debug: bool) -> int:
    if debug and sys.exc_info()[0] is not None:
        import traceback

        traceback.print_exc()
    print(f"kvcompile: error: {message}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)
    if as_json:
        print(dumps({"error": message, "hint": hint, "exit_code": code}))
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
