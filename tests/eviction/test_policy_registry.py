"""Eviction policies added from outside the package (docs/adding-a-policy.md).

This file is the "one new module" of a new policy: it declares two toy policies (a frozen
dataclass subclassing EvictionPolicy, and `register_policy` with its rules) and touches no
package file. `RecentOnly(window)` keeps the last `window` tokens: its logits must equal the
uncompiled model under the mask that policy implies. `MassOnly(budget, recent)` ranks the rest
by accumulated attention mass, as H2O does with no sinks: it must evict exactly as H2O does.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import pytest
import torch

import kvcompile
from kvcompile.api import state_of
from kvcompile.config import H2O, EvictionPolicy, KVConfig
from kvcompile.errors import KVConfigError
from kvcompile.eviction.policies import (
    PolicyRules,
    budget_of,
    register_policy,
    rules_of,
    unregister_policy,
)
from kvcompile.testing import assert_rel_close
from tests.eviction.test_end_to_end import (
    _compiled,
    _masked_reference,
    _sid,
    _sink_window_mask,
    _stream,
)


@dataclass(frozen=True)
class RecentOnly(EvictionPolicy):
    window: int = 16
    name = "toy_recent_only"

    def tokens_kept(self, seq_len: int) -> int:
        return min(seq_len, self.window)


@dataclass(frozen=True)
class MassOnly(EvictionPolicy):
    budget: int = 16
    recent: int = 4
    name = "toy_mass_only"

    def tokens_kept(self, seq_len: int) -> int:
        return min(seq_len, self.budget)


def _recent(p, pos, start, total):
    # pos: [H, L] logical index per slot (-1: hole) -> [H, L] kept whatever the score
    return (pos >= start) & (pos >= total - p.window)


def _mass_recent(p, pos, start, total):
    return (pos >= start) & (pos >= total - p.recent)


@pytest.fixture(scope="module", autouse=True)
def toys():
    register_policy(RecentOnly, PolicyRules(budget=lambda p: p.window, protected=_recent))
    register_policy(MassOnly, PolicyRules(budget=lambda p: p.budget, protected=_mass_recent,
                                          scores=lambda p, mass, obs: mass,
                                          accumulates_mass=True))
    yield
    unregister_policy(RecentOnly)
    unregister_policy(MassOnly)


def test_no_package_module_names_the_toy_policies():
    root = pathlib.Path(kvcompile.__file__).parent
    assert not [p for p in root.rglob("*.py")
                if "RecentOnly" in p.read_text() or "MassOnly" in p.read_text()]


def test_rules_and_dict_form():
    assert budget_of(RecentOnly(7)) == 7
    assert KVConfig(eviction={"policy": "toy_recent_only", "window": 5}).eviction == RecentOnly(5)
    pos = torch.arange(10)[None].expand(2, 10)
    keep = rules_of(RecentOnly(3)).protected(RecentOnly(3), pos, 0, 10)
    assert keep.sum(-1).tolist() == [3, 3]


def test_recent_only_equals_masked_attention():
    ids = torch.randint(1, 96, (1, 36), generator=torch.Generator().manual_seed(1))
    m = _compiled(RecentOnly(12))
    out, cache = _stream(m, ids, 20)
    ref = _masked_reference(ids, _sink_window_mask(36, 20, 0, 12))
    assert_rel_close(out, ref, torch.float32, factor=10, what="RecentOnly logits")
    st = state_of(m)
    assert st.pool.seq_len(_sid(cache)) == 12
    assert st.counters["eviction_runs"] > 0


def test_mass_only_evicts_as_h2o_without_sinks():
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    toy, _ = _stream(_compiled(MassOnly(14, 4)), ids, 18)
    h2o, _ = _stream(_compiled(H2O(14, 4, sinks=0)), ids, 18)
    torch.testing.assert_close(toy, h2o, rtol=0, atol=0)


# --- negative cases ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Unregistered(EvictionPolicy):
    budget: int = 8

    def tokens_kept(self, seq_len: int) -> int:
        return min(seq_len, self.budget)


def test_unregistered_policy_names_the_fix():
    with pytest.raises(KVConfigError, match="register_policy"):
        rules_of(Unregistered())
    m = _compiled(Unregistered())
    with torch.no_grad(), pytest.raises(KVConfigError, match="register_policy"):
        m(input_ids=torch.ones(1, 4, dtype=torch.long))


def test_register_checks_its_arguments():
    with pytest.raises(TypeError, match="EvictionPolicy subclass"):
        register_policy(dict, PolicyRules(budget=len, protected=len))
    with pytest.raises(TypeError, match="PolicyRules"):
        register_policy(Unregistered, {"budget": len})
    with pytest.raises(KVConfigError, match="non-built-in"):
        unregister_policy(H2O)
