"""Compile a model with kvcompile and record what the pass pipeline did to each graph.

`recording(keep_code, stop_after)` wraps the backend's `run_passes` for the duration of a trace,
so the graphs are compiled exactly as `kvcompile.compile` compiles them; it only asks the
pipeline to keep each pass's code (and to stop after a pass), and copies the graph before the
passes for the before/after pictures.
"""

from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kvcompile.cli.common import CLIError, Console


@dataclass
class GraphTrace:
    """One Dynamo graph through the passes."""

    index: int                          # 1-based, in compile order
    result: object                      # passes.pipeline.PipelineResult
    before: fx.Graph                    # a copy of the graph before any pass
    copies: dict                        # original node -> its copy in `before`
    after: fx.GraphModule               # the graph after the passes (rewritten in place)
    inputs: list = field(default_factory=list)   # shapes of the tensor inputs

    @property
    def sites(self) -> list:
        return self.result.plan.sites

    def stages(self) -> list[tuple[str, str, str | None]]:
        """(pass name, summary, code after) for each pass that ran."""
        return [(log.name, log.summary, log.code_after) for log in self.result.logs]

    def diffs(self, context: int = 2) -> list[dict]:
        """Per pass: name, summary, and the unified diff of the graph code it made."""
        out, prev = [], self.result.code_before or ""
        for name, summary, code in self.stages():
            code = code if code is not None else prev
            diff = "".join(difflib.unified_diff(
                prev.splitlines(keepends=True), code.splitlines(keepends=True),
                fromfile=f"graph {self.index} before {name}",
                tofile=f"graph {self.index} after {name}", n=context))
            out.append({"pass": name, "summary": summary, "diff": diff,
                        "lines_changed": sum(1 for ln in diff.splitlines()
                                             if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))})
            prev = code
        return out


@contextlib.contextmanager
def recording(keep_code: bool = True, stop_after: str | None = None):
    """Yields the list that collects a GraphTrace per graph compiled inside the block."""
    import kvcompile.backend as backend_mod
    from kvcompile.passes.pipeline import PASS_NAMES

    if stop_after is not None and stop_after not in PASS_NAMES:
        raise CLIError(f"unknown pass {stop_after!r}", hint="passes: " + ", ".join(PASS_NAMES))
    original = backend_mod.run_passes
    traces: list[GraphTrace] = []

    def run_passes(gm, example_inputs, state, **kwargs):
        copies: dict = {}
        before = fx.Graph()
        out = before.graph_copy(gm.graph, copies)
        if out is not None:
            before.output(out)
        res = original(gm, example_inputs, state, keep_code=keep_code, stop_after=stop_after)
        shapes = [tuple(x.shape) for x in example_inputs
                  if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)]
        traces.append(GraphTrace(len(traces) + 1, res, before, copies, gm, shapes))
        return res

    backend_mod.run_passes = run_passes
    try:
        yield traces
    finally:
        backend_mod.run_passes = original


def drive(lm, prompt_ids: torch.Tensor, new_tokens: int = 2) -> None:
    """Run the compiled model so Dynamo compiles its graphs: for a Hugging Face model a greedy
    generate (prefill graph, then decode graphs), for a plain module one forward."""
    with torch.inference_mode():
        if lm.is_hf:
            lm.model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=_pad_id(lm))
        elif isinstance(lm.inputs, dict):
            lm.compiled(**lm.inputs)
        else:
            lm.compiled(*lm.inputs)


def _pad_id(lm):
    tok = lm.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        return tok.eos_token_id
    return getattr(lm.model.config, "pad_token_id", None) or 0


def prompt_ids(lm, prompt: str | None, n_random: int) -> torch.Tensor:
    """[1, S] ids of `prompt` (the model's tokenizer), or random ids without a tokenizer."""
    if lm.tokenizer is None:
        if prompt is not None:
            raise CLIError(f"{lm.spec} has no tokenizer, so --prompt cannot be encoded",
                           hint="drop --prompt (random ids are used) or --prompt-tokens N")
        return lm.random_prompt(n_random)
    text = prompt or ("The quick brown fox jumps over the lazy dog. Paged attention stores the "
                      "keys and values of every layer in fixed-size pages.")
    return lm.tokenizer(text, return_tensors="pt").input_ids.to(lm.device)


def compile_and_trace(lm, config, console: Console, *, keep_code: bool = False,
                      stop_after: str | None = None, prompt: str | None = None,
                      prompt_tokens: int = 24):
    """Compile `lm` with `config`, run it, and return (traces, state)."""
    import kvcompile
    from kvcompile.api import state_of

    ids = prompt_ids(lm, prompt, prompt_tokens) if lm.is_hf else None
    with recording(keep_code=keep_code, stop_after=stop_after) as traces:
        compiled = kvcompile.compile(lm.model, config)
        lm.compiled = compiled
        with console.stage("compiling and running the passes"):
            drive(lm, ids)
    if not traces:
        raise CLIError(f"Dynamo produced no graph for {lm.spec}",
                       hint="is the forward empty, or fully disabled for torch.compile?",
                       code=1)
    return traces, state_of(lm.model)
