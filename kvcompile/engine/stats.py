"""Engine telemetry: one `StepStats` per step, and cumulative `EngineStats`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepStats:
    step: int
    duration_s: float
    num_running: int          # after the step
    num_waiting: int
    num_swapped: int
    num_scheduled: int        # sequences in the step's forward
    prefill_tokens: int       # prompt (or recompute) tokens computed
    decode_tokens: int
    generated_tokens: int     # tokens sampled
    pages_used: int
    pages_free: int
    pages_cached: int         # pages the prefix cache holds
    preemptions: int          # in this step
    tokens_per_s: float       # tokens computed / step time
    generated_per_s: float
    prefix_hit_rate: float    # cumulative: prompt tokens served from the cache / looked up

    def __str__(self) -> str:
        return (f"step {self.step}: {self.duration_s * 1e3:.1f} ms, running {self.num_running} "
                f"waiting {self.num_waiting} swapped {self.num_swapped}, tokens prefill "
                f"{self.prefill_tokens} decode {self.decode_tokens}, pages used "
                f"{self.pages_used} free {self.pages_free} cached {self.pages_cached}, "
                f"preempted {self.preemptions}, {self.generated_per_s:.0f} gen tok/s, prefix "
                f"hit rate {100 * self.prefix_hit_rate:.0f}%")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineStats:
    steps: int = 0
    requests_added: int = 0
    requests_finished: int = 0    # finished, aborted or failed
    requests_failed: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0      # prefill + decode + recompute
    generated_tokens: int = 0
    preemptions: int = 0
    busy_s: float = 0.0           # time inside step()
    launched_steps: int = 0       # queued on the device, tokens read back a step later
    overlapped_steps: int = 0     # queued before the step before them was read back
    # steps run synchronously because a feature needs the host between steps (engine/overlap.py)
    sync_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def generated_per_s(self) -> float:
        return self.generated_tokens / self.busy_s if self.busy_s else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "generated_per_s": self.generated_per_s}
