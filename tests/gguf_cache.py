"""One GGUF parse per test run: the parsed SmolLM2-135M (config, tokenizer, dequantized
tensors) is saved once to a folder shared by the run's processes, and every other process of
the run (xdist workers, README blocks, examples) loads it from there (about 1 s) instead of
parsing the GGUF file again (16 s of CPU, about 30 s on 2 busy cores, each; six loads in
one run).

tests/conftest.py installs it in the test processes and removes the folder at the end of the
run; `share_with(env)` passes it to a Python subprocess (through tests/_site/sitecustomize.py,
which installs it when kvcompile.models is first imported). Only kvcompile.models._parse_gguf
is replaced, and only its result is shared: the model, its tokenizer and config are built as
before. tests/cli/test_progress.py parses without it (it checks the conversion's progress
bar), and so does any process started without `share_with`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys

VAR = "KVCOMPILE_TEST_GGUF_CACHE"   # read by the tests only, never by the package
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
_DONE = "complete"


def folder_for_run() -> str:
    """The run's folder: one per pytest-xdist run (its workers share it), else per process."""
    import tempfile

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    return os.path.join(tempfile.gettempdir(), f"kvcompile-test-gguf-{run}")


def share_with(env: dict) -> dict:
    """`env` for a subprocess that should load GGUF files through the run's folder."""
    folder = os.environ.get(VAR)
    if folder:
        env[VAR] = folder
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, env.get("PYTHONPATH")) if p)
    return env


def install(folder: str) -> None:
    """Replace kvcompile.models._parse_gguf by a version that goes through `folder`."""
    import kvcompile.models as models

    if getattr(models._parse_gguf, "_shared_folder", None) == folder:
        return
    parse = getattr(models._parse_gguf, "_parse", models._parse_gguf)

    def shared(path: str):
        if path in models._PARSED:
            return models._PARSED[path]
        st = os.stat(path)
        key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{_versions()}"
                             .encode()).hexdigest()[:24]
        where = os.path.join(folder, key)
        os.makedirs(folder, exist_ok=True)
        with _locked(where + ".lock"):
            if os.path.exists(os.path.join(where, _DONE)):
                result = _load(where, os.path.dirname(path))
            else:
                result = parse(path)
                _save(where, result)
        models._PARSED.clear()
        models._PARSED[path] = result
        return result

    shared._shared_folder, shared._parse = folder, parse
    models._parse_gguf = shared


def remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _versions() -> str:
    import torch
    import transformers

    return f"{transformers.__version__} {torch.__version__}"


@contextlib.contextmanager
def _locked(path: str):
    """The first process parses; the others wait for it (on a busy machine the wait frees the
    cores for the one parse) and then load what it saved."""
    import fcntl

    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save(where: str, result) -> None:
    import torch
    from safetensors.torch import save_file

    cfg, tok, tensors = result
    tmp = where + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    save_file({k: (v if isinstance(v, torch.Tensor) else torch.from_numpy(v)).contiguous()
               for k, v in tensors.items()}, os.path.join(tmp, "tensors.safetensors"))
    open(os.path.join(tmp, _DONE), "w").close()
    shutil.rmtree(where, ignore_errors=True)
    os.replace(tmp, where)


def _load(where: str, origin: str):
    """What _parse_gguf returned, named as the parse names it (the GGUF file's folder)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg, tok = AutoConfig.from_pretrained(where), AutoTokenizer.from_pretrained(where)
    cfg._name_or_path = tok.name_or_path = origin
    return cfg, tok, load_file(os.path.join(where, "tensors.safetensors"))


class _InstallOnImport:
    """A meta-path finder for subprocesses (tests/_site/sitecustomize.py): once
    kvcompile.models is imported, install the shared parse into it."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != "kvcompile.models":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, folder = spec.loader.exec_module, self.folder

        def exec_and_install(module):
            exec_module(module)
            sys.modules[name] = module
            install(folder)

        spec.loader.exec_module = exec_and_install
        return spec


def install_on_import(folder: str) -> None:
    sys.meta_path.insert(0, _InstallOnImport(folder))
