"""SamplingParams: how one engine request samples and when it stops.

    SamplingParams(max_tokens=64)                                  # multinomial at temperature 1
    SamplingParams(temperature=0, max_tokens=64)                   # greedy
    SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=1, stop=["\\n\\n"])

Field names and defaults follow vLLM. Every bad value raises `RequestError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompile.config import EvictionPolicy, _coerce_eviction
from kvcompile.errors import KVCompileError, KVConfigError


class RequestError(KVCompileError, ValueError):
    """A request the engine cannot run (empty prompt, too long, bad sampling parameters). The
    engine's state is unchanged and every other request goes on."""


def _bad(field: str, value, allowed: str) -> RequestError:
    return RequestError(f"SamplingParams.{field}={value!r} is not allowed; allowed: {allowed}.")


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: new tokens at most. temperature: 0 = greedy (argmax). top_k: 0 = off.
    top_p: nucleus mass (1 = off). min_p: drop tokens below min_p * p(top token) (0 = off).
    repetition_penalty: HF-style, on tokens of the prompt and output (1 = off). seed: per-request
    generator, so a request samples the same tokens whatever else runs with it. stop: strings
    that end the output (needs a tokenizer); stop_token_ids: extra end tokens; ignore_eos: keep
    going past EOS; min_tokens: no EOS / stop before this many tokens. logprobs: return the
    log-probability of each sampled token (after temperature and filtering).
    eviction: which tokens this request's KV cache keeps: "model" (the policy the model was
    compiled with, KVConfig.eviction), None (every token), or a policy (`SinkWindow(4, 1020)`,
    `H2O(...)`, `SnapKV(...)`, or a dict as KVConfig takes). A policy other than "model" needs a
    model compiled with an eviction policy (the layers it manages)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    skip_special_tokens: bool = True
    eviction: EvictionPolicy | str | None = "model"

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _int(self, "max_tokens", 1)
        _int(self, "top_k", 0)
        _int(self, "min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        _float(self, "temperature", 0.0, None)
        _float(self, "top_p", 0.0, 1.0, open_low=True)
        _float(self, "min_p", 0.0, 1.0)
        _float(self, "repetition_penalty", 0.0, None, open_low=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed,
                                                                                     int)):
            raise _bad("seed", self.seed, "None or an int")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", self.stop, "non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "token ids (ints >= 0)")
        if self.eviction != "model":
            try:
                object.__setattr__(self, "eviction", _coerce_eviction(self.eviction))
            except KVConfigError as e:
                raise _bad("eviction", self.eviction, "'model', None, or an eviction policy "
                           f"(SinkWindow, H2O, SnapKV or a registered one): {e}") from None
        for name in ("ignore_eos", "include_stop_str_in_output", "logprobs",
                     "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True, False")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """True when top-k / top-p / min-p change the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _int(p: SamplingParams, name: str, lo: int) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(name, v, f"an int >= {lo}")


def _float(p: SamplingParams, name: str, lo: float, hi: float | None, open_low=False) -> None:
    v = getattr(p, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    ok = ok and (v > lo if open_low else v >= lo) and (hi is None or v <= hi)
    if not ok:
        low = f"({lo}" if open_low else f"[{lo}"
        raise _bad(name, v, f"a float in {low}, {'inf)' if hi is None else f'{hi}]'}")
    object.__setattr__(p, name, float(v))
