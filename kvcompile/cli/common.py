"""What every `kvcompile` command shares: exit codes, errors, output, progress, devices.

A command is `run(args) -> Result`: `payload` is what `--json` prints (one JSON object on
stdout), `text` what a person reads. Errors are raised as `CLIError(message, hint, code)`; main.py
prints them as one line plus a hint (the traceback only with --debug).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# Exit codes (docs/cli.md lists them; tests check them).
EXIT_OK = 0
EXIT_INTERNAL = 1       # an unexpected error: a bug in kvcompile (rerun with --debug)
EXIT_USAGE = 2          # bad command line: unknown option or value, unknown pass, bad config
EXIT_MODEL = 3          # the model cannot be found or loaded
EXIT_VERIFY = 4         # --verify: a layer or the final logits diverged beyond tolerance
EXIT_UNAVAILABLE = 5    # needs what this machine lacks: CUDA, an optional package, a harness
EXIT_RUNTIME = 6        # kvcompile refused at run time (pool full, sequence too long, ...)
EXIT_INTERRUPTED = 130  # Ctrl-C

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_INTERNAL: "unexpected error (a bug: rerun with --debug and report the traceback)",
    EXIT_USAGE: "bad command line: unknown option or value, unknown pass, bad KVConfig value",
    EXIT_MODEL: "the model cannot be found or loaded",
    EXIT_VERIFY: "inspect --verify: a layer, or the final logits, diverged from eager beyond "
                 "tolerance (the logits: beyond the storage format's bound)",
    EXIT_UNAVAILABLE: "needs something this machine lacks (CUDA, an optional package, a "
                      "benchmark script)",
    EXIT_RUNTIME: "kvcompile refused at run time (KV pool full, sequence too long, cache state)",
    EXIT_INTERRUPTED: "interrupted",
}


class CLIError(Exception):
    """An error the CLI reports as one line plus a hint, with exit code `code`."""

    def __init__(self, message: str, hint: str = "", code: int = EXIT_USAGE):
        super().__init__(message)
        self.message, self.hint, self.code = message, hint, code


@dataclass
class Result:
    payload: dict
    text: str = ""
    code: int = EXIT_OK
    extra_json: dict = field(default_factory=dict)


def to_jsonable(x):
    """Tensors, dtypes, devices, dataclasses and non-finite floats -> plain JSON values."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else (None if math.isnan(x) else str(x))
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, torch.Tensor):
        return to_jsonable(x.tolist())
    if hasattr(x, "__dataclass_fields__"):
        return to_jsonable(dict(x.__dict__))
    return str(x)


def dumps(payload: dict) -> str:
    return json.dumps(to_jsonable(payload), indent=2, sort_keys=False)


# --- progress ---------------------------------------------------------------------------------

class Console:
    """Where progress and notes go: stderr, for a person, never with --json / --quiet.

    On a terminal (`enabled`): `what ... 3.2 s` around each step, tqdm bars, notes. Where stderr
    is no terminal (a log file, a pipe, CI: `lines`): no bars and no notes, but one line when a
    long step starts, `kvcompile: what (about ...) ...`, so a log never sits silent for a
    minute without saying why. Steps are long when the caller gives their expected duration
    (`about`); quick ones (tiny models, factories) print nothing there."""

    def __init__(self, enabled: bool, lines: bool = False):
        self.enabled = enabled
        self.lines = lines and not enabled

    @classmethod
    def for_args(cls, args) -> Console:
        quiet = getattr(args, "json", False) or getattr(args, "quiet", False)
        terminal = sys.stderr.isatty() or getattr(args, "progress", False)
        return cls(not quiet and terminal, lines=not quiet and not terminal)

    def note(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=sys.stderr, flush=True)

    @contextmanager
    def stage(self, what: str, about: str | None = None):
        """`what (about) ... 3.2 s` on stderr around a step on a terminal; elsewhere
        `kvcompile: what (about) ...` when it starts, for long steps (`about` given). Yields a
        timer dict."""
        timer = {"seconds": 0.0}
        label = f"{what} ({about})" if about else what
        if self.enabled:
            print(f"{label} ...", end="", file=sys.stderr, flush=True)
        elif self.lines and about:
            print(f"kvcompile: {label} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            yield timer
        finally:
            timer["seconds"] = time.perf_counter() - t0
            if self.enabled:
                print(f" {timer['seconds']:.1f} s", file=sys.stderr, flush=True)

    def progress(self, total: int | None, desc: str):
        return Progress(total, desc, self.enabled)


class Progress:
    """tqdm when installed, else a line every 2 s; silent when disabled."""

    def __init__(self, total: int | None, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._bar, self._t0, self._last = None, time.perf_counter(), 0.0
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                self._bar = None

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= 2.0 or self.n == self.total:
            self._last = now
            of = f"/{self.total}" if self.total else ""
            print(f"{self.desc}: {self.n}{of} ({now - self._t0:.0f} s)", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- devices and dtypes -----------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda was asked for, but CUDA is not available here",
                       hint="use --device cpu (or auto)", code=EXIT_UNAVAILABLE)
    return dev


def pick_dtype(name: str | None) -> torch.dtype | None:
    if name is None or name == "auto":
        return None
    return DTYPES[name]


def load(args, console: Console):
    """args.model -> LoadedModel, with model errors as CLIError(EXIT_MODEL)."""
    from kvcompile.models import ModelNotFoundError, load_model

    device = pick_device(getattr(args, "device", "auto"))
    with console.stage(f"loading {args.model}", about=load_about(args.model)):
        try:
            return load_model(args.model, device=device, dtype=pick_dtype(args.dtype))
        except ModelNotFoundError as e:
            raise CLIError(str(e), e.hint, EXIT_MODEL) from e
        except pickle.UnpicklingError as e:
            raise CLIError(f"cannot load {args.model!r}: torch.load refused its pickle "
                           f"checkpoint: {_unpickling_reason(e)}",
                           "convert it to safetensors where you trust its source, or load it "
                           "yourself and give a module:factory", EXIT_MODEL) from e
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot load {args.model!r}: {e}".splitlines()[0],
                           "check the path, or try --debug for the full traceback",
                           EXIT_MODEL) from e
        except TypeError as e:
            if _innermost_function(e) != "_load_factory":
                raise  # raised inside the factory: its own error
            raise CLIError(f"cannot call {args.model}: {e}",
                           "MODULE:FACTORY must be callable without arguments; wrap it, e.g. "
                           "def make(): return factory(...)", EXIT_MODEL) from e
        except Exception as e:  # noqa: BLE001
            if not _in_gguf_reader(e):
                raise
            raise CLIError(f"cannot read the GGUF file of {args.model!r}: "
                           f"{_type_name(e)}: {_first(e)}",
                           "the file looks truncated or damaged: check its size, or copy it "
                           "again", EXIT_MODEL) from e


def load_about(spec: str) -> str | None:
    """What loading `spec` does and roughly how long it takes, for the progress line; None
    for the quick ones (tiny-* models, factories, checkpoints of a few MB, a spec that names
    nothing)."""
    from kvcompile.models import SMOLLM2_ALIASES

    s = str(spec).strip()
    if s.lower() in SMOLLM2_ALIASES:
        return "SmolLM2-135M's GGUF: tokenizer, config, weights dequantized; about 30 s on 2 " \
               "CPU cores"
    path = os.path.expanduser(s)
    try:
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
            path = os.path.join(path, ggufs[0]) if len(ggufs) == 1 else path
        if os.path.isfile(path) and path.endswith(".gguf"):
            # SmolLM2-135M's 98 MB Q4_1 file takes about 30 s on 2 cores
            seconds = 30 * os.path.getsize(path) / 98e6
            if seconds >= 5:
                return f"a {fmt_bytes(os.path.getsize(path))} GGUF, weights dequantized by " \
                       f"transformers; about {max(10, round(seconds, -1)):.0f} s on 2 CPU cores"
        elif os.path.isfile(os.path.join(path, "config.json")):
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                       if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
            if size >= 100e6:
                return f"a Hugging Face checkpoint, {fmt_bytes(size)} of weights"
    except OSError:
        pass
    return None


def _type_name(e: BaseException) -> str:
    mod = type(e).__module__
    return type(e).__name__ if mod == "builtins" else f"{mod.lstrip('_')}.{type(e).__name__}"


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _frames(e: BaseException) -> list:
    import traceback

    return traceback.extract_tb(e.__traceback__)


def _innermost_function(e: BaseException) -> str:
    frames = _frames(e)
    return frames[-1].name if frames else ""


def _in_gguf_reader(e: BaseException) -> bool:
    # the `gguf` package's reader, or transformers' GGUF converter
    return any(f"{os.sep}gguf{os.sep}" in f.filename or "gguf_pytorch_utils" in f.filename
               for f in _frames(e))


def _unpickling_reason(e: BaseException) -> str:
    """torch.load's multi-paragraph refusal -> the one line that says what it refused."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            return line[len("WeightsUnpickler error:"):].strip().split(". Please use")[0]
    return _first(e)


def kv_config(args, **overrides):
    """The KVConfig of a command's --kv-dtype / --page-size / --max-kv-mib / --inner options."""
    from kvcompile.config import KVConfig

    if not (args.max_kv_mib > 0 and math.isfinite(args.max_kv_mib)):
        raise CLIError(f"--max-kv-mib must be a finite number of MiB > 0, got "
                       f"{args.max_kv_mib}", hint="e.g. --max-kv-mib 256")
    fields = dict(kv_dtype=args.kv_dtype, page_size=args.page_size, inner=args.inner,
                  max_kv_bytes=int(args.max_kv_mib * 2**20),
                  eviction=parse_eviction(getattr(args, "eviction", None)))
    fields.update(overrides)
    return KVConfig(**fields)


def parse_eviction(spec: str | None) -> dict | None:
    """'h2o:budget=512,recent=128' -> {'policy': 'h2o', 'budget': 512, 'recent': 128}; the
    values are checked by the policy's dataclass (KVConfigError names the field)."""
    if not spec or spec == "none":
        return None
    name, _, rest = spec.partition(":")
    out: dict = {"policy": name.strip()}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise CLIError(f"--eviction {spec!r}: {item!r} is not key=value",
                           hint="e.g. --eviction sink_window:sinks=4,window=1020")
        v = value.strip()
        out[key.strip()] = (int(v) if v.lstrip("-").isdigit() else
                            v.lower() == "true" if v.lower() in ("true", "false") else v)
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: list[list], header: list[str]) -> str:
    """A plain text table, columns padded to their widest cell."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def resolve_inner(name: str, device: torch.device, cpu_default: str = "aot_eager") -> str:
    """--inner auto: inductor on CUDA. On the CPU, inductor's C++ codegen takes minutes for a
    30-layer model on 2 cores, so `cpu_default`: aot_eager for inspect (AOTAutograd
    functionalizes the rewritten graph as inductor would), eager for the demo (the fastest start;
    the passes and the cache are the same)."""
    if name != "auto":
        return name
    return "inductor" if torch.device(device).type == "cuda" else cpu_default
