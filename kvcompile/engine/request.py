"""One engine request: its tokens, where its KV lives, its text, and what it reports.

A request's tokens are `prompt_ids + output_ids`; `num_computed` of them have their K/V in the
pool. Every step computes the next `num_tokens - num_computed` (or a chunk of them) and, when it
reaches the end, samples one more token. A fresh prompt, a decode step and a recompute after
preemption are the same thing: only `num_computed` differs.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np

from kvcompile.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # no pages yet (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted; pages in host memory
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a request has produced so far. `new_*` hold what the last step added (streaming);
    `token_ids` / `text` everything. finish_reason: "stop" (EOS, stop token or stop string),
    "length" (max_tokens or max_model_len), "abort", "error" (see `error`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 generator, tokenizer=None, on_output=None):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self._prompt_np = None   # token_array's prompt ids, built at its first call
        self.output_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.status = Status.WAITING
        self.seq_id: int | None = None
        self.num_computed = 0
        self.swapped = None                   # pool.SwappedSequence while SWAPPED
        self.aside = None                     # its eviction bookkeeping while swapped aside
        self.page_hashes: list[bytes] = []    # digest of each full page of tokens, in order
        self.num_registered = 0               # full pages offered to the prefix cache
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # an eviction policy applies (engine.py): prompt chunks stop at the prompt's end and
        # later tokens are computed one per step, so a recompute replays each eviction
        self.evicts = False
        # Engine.prefill_eviction_chunk: the prompt is evicted after every `evict_every` of
        # its tokens (0: at its end only); `peak_tokens`: what it stores at most meanwhile
        self.evict_every = 0
        self.peak_tokens: int | None = None
        # the most tokens its policies keep once evicted (None: a layer keeps every token)
        self.keep_tokens: int | None = None
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.on_output = on_output
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.detok = Detokenizer(tokenizer, self.prompt_ids, params) if tokenizer else None
        self._emitted_tokens = 0
        # overlapped steps (engine/overlap.py): the last `unresolved` output ids are
        # placeholders for tokens sampled on the device and not read back yet; `hold`: a
        # length limit ends the request at the next read-back, so it is not scheduled
        self.unresolved = 0
        self.hold = False

    # -- tokens ---------------------------------------------------------------------------------
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def token_array(self, start: int, stop: int) -> np.ndarray:
        """tokens(start, stop) as an int64 array; the prompt's array is built once (a large
        prefill step's ids by one concatenation instead of a Python list of every token)."""
        n = len(self.prompt_ids)
        if self._prompt_np is None:
            self._prompt_np = np.asarray(self.prompt_ids, dtype=np.int64)
        if stop <= n:
            return self._prompt_np[start:stop]
        return np.asarray(self.tokens(start, stop), dtype=np.int64)

    def tokens(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    @property
    def resolved_ids(self) -> list[int]:
        """Output ids read back on the host (without the overlapped step's placeholders)."""
        return self.output_ids[:len(self.output_ids) - self.unresolved]

    def drop_unresolved(self) -> None:
        """Forget the placeholders: their tokens will never be read (the request ended)."""
        if self.unresolved:
            del self.output_ids[len(self.output_ids) - self.unresolved:]
            self.unresolved = 0
        self.hold = False

    def finish(self, reason: str, error: str | None = None, stop_string: bool = False) -> None:
        self.drop_unresolved()
        if self.detok is not None and not stop_string:
            self.detok.flush()
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

    # -- output ---------------------------------------------------------------------------------
    def output(self) -> RequestOutput:
        """The output since the last call (new tokens / text) and in all."""
        ids = self.resolved_ids
        new_ids = ids[self._emitted_tokens:]
        self._emitted_tokens = len(ids)
        text, new_text = ("", "")
        if self.detok is not None:
            text, new_text = self.detok.text, self.detok.take_new(self.finished)
        return RequestOutput(
            request_id=self.id, prompt_token_ids=self.prompt_ids, token_ids=ids,
            new_token_ids=new_ids, text=text, new_text=new_text, finished=self.finished,
            finish_reason=self.finish_reason, error=self.error,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            num_cached_tokens=self.num_cached_tokens, num_preemptions=self.num_preemptions,
            arrival_time=self.arrival_time, first_token_time=self.first_token_time,
            finish_time=self.finish_time)


class Detokenizer:
    """Incremental text of a request's output, and stop-string detection.

    Each new token is decoded in the context of the tokens since the last settled point
    (`prefix`), as vLLM does, so a token whose text depends on its neighbours (byte pieces,
    leading spaces) is read in context. A token whose text ends in an incomplete UTF-8
    character waits for the next one. Text that could be the start of a stop string is held
    back from streaming until it is settled. When the request ends (not on a stop string), the
    text becomes the decode of every output token."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.tok = tokenizer
        self.params = params
        self.ids: list[int] = []
        self.text = ""              # output text so far (cut at a stop string)
        self._sent = 0              # characters of `text` already streamed
        self._prefix = 0            # ids[prefix:read] decode to the end of `text`
        self._read = 0
        self.max_stop = max((len(s) for s in params.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, token: int) -> str | None:
        """Append a token; return the stop string it completes, if any (text is then cut)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None   # nothing new yet, or an incomplete character
        old_len = len(self.text)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._check_stop(old_len)

    def flush(self) -> None:
        """The request ended (not on a stop string): the text is every token, decoded."""
        self.text = self._decode(self.ids)

    def _check_stop(self, old_len: int) -> str | None:
        if not self.params.stop:
            return None
        start = max(0, old_len - self.max_stop + 1)
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[:i + len(s)] if self.params.include_stop_str_in_output \
            else self.text[:i]
        return s

    def take_new(self, final: bool) -> str:
        """Text not yet streamed, holding back what may still change (unless final)."""
        end = len(self.text)
        if not final and self.max_stop:
            end = max(self._sent, end - self.max_stop + 1)
        if not final and self.text.endswith("\ufffd"):
            end = min(end, len(self.text) - 1)
        new = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return new
