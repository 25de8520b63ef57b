"""The pass pipeline: find attention, find the cache, resolve configs, rewrite, rotate, eviction.

Every pass runs one attention site at a time (the functions named in PASS_FUNCTIONS), and a pass
that raises for one site leaves that site exactly as it was, with the exception's one-line
reason in `kvcompile.report`; compilation of the other sites goes on:

- the analysis passes (find_attention, find_cache, resolve_config) change no code: the site is
  marked left alone and the pipeline carries on;
- the passes that change the graph (rewrite, rotate, eviction) may have changed it halfway: the
  graph is restored from the copy taken before the passes and the pipeline runs again, with that
  site left alone from the start.

A failure that belongs to no one site (the final lint or recompile) is retried once with a lint
after every site's rewrite, which pins it on a site; if that does not, the graph is compiled as
it came, every site left alone, and a warning says so. A config that no storage format can
honour is the user's to fix: every site refused raises KVConfigError naming the field, some
sites refused warn once each. A site rewritten in an earlier graph of the model keeps its cache
in the pool, so it can never silently run without kvcompile in a later one (CacheStateError).

Each pass is recorded (what it found or changed, and optionally the graph code after it) so the
report and `kvcompile inspect --passes` can show every step.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kvcompile.errors import CacheStateError, KVConfigError
from kvcompile.passes import notices
from kvcompile.passes.eviction import eviction_pass
from kvcompile.passes.find_attention import _site_location, candidates, match_attention, name_sites
from kvcompile.passes.find_cache import find_cache  # noqa: F401  (called via PASS_FUNCTIONS)
from kvcompile.passes.rewrite import RewritePlan, finish_rewrite
from kvcompile.passes.rewrite import rewrite_site as rewrite_attention_site
from kvcompile.passes.rewrite_latent import rewrite_latent_site
from kvcompile.passes.rotate import (
    finish_rotation,
    rotate_site,  # noqa: F401
    rotation_context,
    wants_rotation,
)
from kvcompile.passes.site_config import config_scope
from kvcompile.passes.site_formats import (  # noqa: F401  (configure_site: PASS_FUNCTIONS)
    FormatProblem,
    configure_site,
    pick,
    quoted,
    refusal,
)
from kvcompile.passes.sites import AttentionSite, NearMiss, SiteRecord
from kvcompile.runtime.context import PACKED_TAG

PASS_NAMES = ("find_attention", "find_cache", "resolve_config", "rewrite", "rotate",
              "eviction")
# The per-site function of each pass (module globals here, so tests can make one fail).
PASS_FUNCTIONS = {"find_attention": "match_attention", "find_cache": "find_cache",
                  "resolve_config": "configure_site", "rewrite": "rewrite_site",
                  "rotate": "rotate_site", "eviction": "evict_site"}
_CHANGES_CODE = ("rewrite", "rotate", "eviction")


@dataclass
class PassLog:
    name: str
    summary: str
    code_after: str | None = None


@dataclass
class PipelineResult:
    plan: RewritePlan
    logs: list[PassLog] = field(default_factory=list)
    code_before: str | None = None
    near_misses: list[NearMiss] = field(default_factory=list)
    pristine: fx.Graph | None = None      # the graph as Dynamo gave it
    checkpoint: _Checkpoint | None = None  # the model's state before this graph's passes

    def abandon(self, gm: fx.GraphModule, state, reason: str) -> None:
        """Put the graph back as it came and leave every site alone (the inner compiler failed
        on the rewritten graph): the backend then compiles the original."""
        _restore(gm, self.pristine)
        if self.checkpoint is not None:
            self.checkpoint.restore(state)   # the layers this graph added leave the pool
        rewritten = [s for s in self.plan.sites if s.rewritten]
        for s in self.plan.sites:
            s.rewritten = False
            s.reason = s.reason or reason
        _check_consistent(self.plan.sites, state, before=len(state.records) - len(
            self.plan.sites))
        state.count("attention_rewritten", -len(rewritten))
        state.count("attention_skipped", len(rewritten))
        for rec in state.records[len(state.records) - len(self.plan.sites):]:
            rec.rewritten, rec.reason = False, rec.reason or reason
        self.plan = RewritePlan(sites=self.plan.sites)
        notices.warn_once(state, ("abandoned", state.graphs),
                          f"kvcompile left graph {state.graphs} of {notices.model_name(state)} "
                          f"as it was: {reason}")


class _Restart(Exception):
    """A pass changing the graph failed: start again from the copy, this site left alone
    (`site` None: the failure belongs to no one site)."""

    def __init__(self, site: str | None, reason: str):
        super().__init__(reason)
        self.site, self.reason = site, reason


def run_passes(gm: fx.GraphModule, example_inputs, state, *, keep_code: bool = False,
               stop_after: str | None = None, configured: Sequence = (),
               packed_steps: bool = False) -> PipelineResult:
    """The passes over one Dynamo graph. `configured`: the module instances that carry
    `@kvcompile.configure` overrides (the caller collects them: passes read no global registry).
    `packed_steps`: the graph is traced inside a `kvcompile.Engine` step (its plan packs the
    step's sequences as one row; the caller reads that from the forward context): the ops get
    no mask (passes/mask_inputs.py `drop_masks`) and may run only in such steps."""
    if stop_after is not None and stop_after not in PASS_NAMES:
        raise ValueError(f"unknown pass {stop_after!r}; passes: {', '.join(PASS_NAMES)}")
    pristine = copy.deepcopy(gm.graph, {})
    code_before = gm.code if keep_code else None
    excluded: dict[str, str] = {}
    careful = False
    while True:
        checkpoint = _Checkpoint(state)
        run = _Run(gm, example_inputs, state, keep_code, stop_after, excluded, careful,
                   configured, packed_steps)
        try:
            res = run.go()
        except _Restart as r:
            checkpoint.restore(state)
            _restore(gm, pristine)
            if r.site is None and not careful:
                careful = True           # lint after each site: find the one it belongs to
            elif r.site is not None and r.site not in excluded:
                excluded[r.site] = r.reason
            else:
                res = _leave_all_alone(gm, pristine, state, r.reason)
                break
            continue
        except (KVConfigError, CacheStateError):
            checkpoint.restore(state)
            _restore(gm, pristine)
            raise
        except Exception as e:  # noqa: BLE001  (never crash: compile the graph as it came)
            checkpoint.restore(state)
            _restore(gm, pristine)
            res = _leave_all_alone(gm, pristine, state, "kvcompile's passes failed on this "
                                   f"graph: {_one_line(e)}")
        break
    res.code_before, res.pristine, res.checkpoint = code_before, pristine, checkpoint
    return res


# --- one pass over the graph -------------------------------------------------------------------

class _Run:
    def __init__(self, gm, example_inputs, state, keep_code, stop_after, excluded, careful,
                 configured=(), packed_steps=False):
        self.gm, self.inputs, self.state = gm, example_inputs, state
        self.packed_steps = packed_steps
        self.configured = list(configured)
        self.keep_code, self.stop_after = keep_code, stop_after
        self.excluded, self.careful = excluded, careful
        self.res = PipelineResult(plan=RewritePlan())

    def log(self, name: str, summary: str) -> bool:
        self.res.logs.append(PassLog(name, summary, self.gm.code if self.keep_code else None))
        return self.stop_after == name

    def guard(self, name: str, site: AttentionSite, *args):
        """Run pass `name` on one site; a failure leaves the site alone (or restarts)."""
        fn = globals()[PASS_FUNCTIONS[name]]
        try:
            out = fn(*args)
            if self.careful and name in _CHANGES_CODE:
                self.gm.graph.lint()
            return out
        except (KVConfigError, CacheStateError, FormatProblem, _Restart):
            raise
        except Exception as e:  # noqa: BLE001
            reason = f"{name} pass failed: {_one_line(e)}"
            if name in _CHANGES_CODE:
                raise _Restart(site.name, reason) from e
            site.skip(reason)
            return None

    def go(self) -> PipelineResult:
        gm, state, res = self.gm, self.state, self.res
        sites = self.find_sites()
        patterns = ", ".join(sorted({f"{s.pattern}/{s.gqa}" for s in sites})) or "-"
        if self.log("find_attention", f"{len(sites)} attention site(s): {patterns}"):
            return res
        for site in sites:
            if not site.reason:
                self.guard("find_cache", site, gm, site)
        kinds = ", ".join(sorted({s.cache_kind for s in sites if s.k_cache})) or "-"
        if self.log("find_cache", f"cache ops: {kinds}; "
                    f"{sum(1 for s in sites if s.reason)} site(s) not rewritable"):
            return res
        self.configure(sites)
        if self.log("resolve_config", f"{sum(1 for s in sites if s.layer_spec is not None)} "
                    f"layer(s) configured"):
            return res
        # the config's hash goes into the graph (the op's `tag`), so inductor's cache key
        # changes with the config; a hash keeps `--passes` diffs readable
        tag = "kvcompile-" + hashlib.sha1(state.config.cache_key().encode()).hexdigest()[:12]
        if self.packed_steps:
            tag += PACKED_TAG
        handles: list = []
        for site in sites:
            if site.reason or not site.config.enabled:
                if not site.reason:
                    site.skip("disabled by configure(enabled=False)")
                continue
            self.guard("rewrite", site, gm, site, tag, handles)
            if site.rewritten:
                site.layer_index = self.layer_index(site)
        res.plan = self.finish(finish_rewrite, gm, sites, handles, self.packed_steps)
        n = len(res.plan.rewritten)
        if self.log("rewrite", f"{n} of {len(sites)} site(s) rewritten onto the pool"):
            return self.commit()
        if self.log("rotate", self.rotate()):
            return self.commit()
        self.log("eviction", self.evict())
        return self.commit()

    def find_sites(self) -> list[AttentionSite]:
        sites = []
        for node in candidates(self.gm):
            try:
                found = match_attention(node)
            except Exception as e:  # noqa: BLE001
                found = _failed_site(node, f"find_attention pass failed: {_one_line(e)}")
            if isinstance(found, NearMiss):
                self.res.near_misses.append(found)
            elif found is not None:
                sites.append(found)
        name_sites(sites)
        self.res.plan.sites = sites
        grad = _needs_grad(self.inputs)
        for site in sites:
            if site.name in self.excluded:
                site.skip(self.excluded[site.name])
            elif grad:
                site.skip(site.reason or "autograd is recording (parameters require grad): "
                          "kvcompile rewrites inference graphs; run under torch.no_grad() or "
                          "torch.inference_mode()")
        return sites

    def configure(self, sites: list[AttentionSite]) -> None:
        scope = config_scope(self.gm, self.inputs, self.configured)
        refused: list[tuple[AttentionSite, FormatProblem]] = []
        for site in sites:
            if site.reason:
                continue
            try:
                self.guard("resolve_config", site, site, self.state, scope)
            except FormatProblem as p:
                site.skip(f"format not applicable: KVConfig.{p.field}={p.value!r}: {p.reason}")
                refused.append((site, p))
        if not refused:
            return
        configured = [s for s in sites if s.layer_spec is not None]
        if not configured and not any(r.rewritten for r in self.state.records):
            raise refusal(refused, self.state)
        for site, p in refused:
            notices.warn_once(self.state, ("format", site.name),
                              f"kvcompile left attention site {site.name} of "
                              f"{notices.model_name(self.state)} alone: KVConfig.{p.field}="
                              f"{p.value!r} cannot store it: {p.reason}. Formats that fit: "
                              f"{quoted(p.fits)}; give this module one with "
                              f"kvcompile.configure(module, {p.field}={pick(p.fits)!r})")

    def layer_index(self, site: AttentionSite) -> int:
        """The pool layer the site will have: it joins the pool at commit, when no pass can
        fail for it any more (a new layer cannot join while sequences are cached)."""
        idx = self.state.layer_names.get(site.name)
        if idx is None:
            new = self.__dict__.setdefault("new_layers", [])
            idx = len(self.state.layer_specs) + len(new)
            new.append(site.name)
        return idx

    def finish(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  (belongs to no one site)
            raise _Restart(None, f"the graph did not check after the rewrite: "
                           f"{_one_line(e)}") from e

    def rotate(self) -> str:
        sites = [s for s in self.res.plan.rewritten if wants_rotation(s)]
        if not sites:
            return "no site asks for rotate='hadamard'"
        ctx = rotation_context(self.gm, self.state, self.inputs)
        modes = [self.guard("rotate", s, self.gm, s, self.state, ctx) or "" for s in sites]
        for s in sites:
            why = getattr(s, "rotation", "")
            if why.startswith("not rotated"):
                notices.warn_once(self.state, ("rotate", s.name),
                                  f"kvcompile did not rotate attention site {s.name} of "
                                  f"{notices.model_name(self.state)} (KVConfig.rotate="
                                  f"'hadamard'): {why[len('not rotated: '):]}")
        return self.finish(finish_rotation, self.gm, modes)

    def evict(self) -> str:
        sites = [s for s in self.res.plan.rewritten if s.config.eviction]
        if not sites:
            return "no eviction policy"
        summary = ""
        for s in sites:
            summary = self.guard("eviction", s, self.gm, s, self.state) or summary
        if len(sites) == 1:
            return summary
        kinds: dict[str, int] = {}
        for s in sites:
            name = SiteRecord.of(s, 0).eviction
            kinds[name] = kinds.get(name, 0) + 1
        tail = summary[summary.rfind(" ("):] if " (" in summary else ""
        return (f"{len(sites)} layer(s) evict: "
                + "; ".join(f"{k} x{v}" for k, v in kinds.items()) + tail)

    def commit(self) -> PipelineResult:
        """The run succeeded: count, record, and say what was not done."""
        state, sites = self.state, self.res.plan.sites
        _check_consistent(sites, state, before=len(state.records))
        for s in self.res.plan.rewritten:
            if state.register_layer(s, s.layer_spec, s.layer_meta) != s.layer_index:
                raise CacheStateError(f"attention site {s.name}: pool layer changed while "
                                      f"compiling (a bug in kvcompile's pipeline)")
        n = len(self.res.plan.rewritten)
        state.count("attention_rewritten", n)
        state.count("attention_skipped", len(sites) - n)
        torch._dynamo.utils.counters["kvcompile"]["attention_rewritten"] += n
        torch._dynamo.utils.counters["kvcompile"]["attention_skipped"] += len(sites) - n
        state.graphs += 1
        for s in sites:
            rec = SiteRecord.of(s, state.graphs)
            rec.rotate = getattr(s, "rotation", "") or rec.rotate  # what the rotate pass did
            state.records.append(rec)
        misses = state.__dict__.setdefault("near_misses", [])
        for m in self.res.near_misses:
            m.graph = state.graphs
            misses.append(m)
        for s in sites:
            if s.reason and "pass failed" in s.reason:
                notices.warn_once(state, ("failed", s.name),
                                  f"kvcompile left attention site {s.name} of "
                                  f"{notices.model_name(state)} alone: {s.reason}")
        notices.warn_if_nothing_rewritten(self.gm, state, self.res)
        notices.warn_if_rewritten_only_elsewhere(state, sites)
        return self.res


# --- the per-site passes defined here ----------------------------------------------------------

def rewrite_site(gm: fx.GraphModule, site: AttentionSite, tag: str, handles: list) -> None:
    """rewrite for one site: an MLA site onto latent pages (rewrite_latent.py), any other onto
    K/V pages (rewrite.py)."""
    if site.latent is not None:
        return rewrite_latent_site(gm, site, tag, handles)
    return rewrite_attention_site(gm, site, tag, handles)


def evict_site(gm: fx.GraphModule, site: AttentionSite, state) -> str:
    """eviction for one site: binds its layer to its policy (passes/eviction.py)."""
    return eviction_pass(gm, _OneSite([site]), state)


@dataclass
class _OneSite:
    rewritten: list


# --- helpers -----------------------------------------------------------------------------------

def _failed_site(node: fx.Node, reason: str) -> AttentionSite:
    name, cls, stack = _site_location(node)
    return AttentionSite(name=name, module_class=cls, module_stack=stack,
                         pattern="sdpa" if "attention" in str(node.target) else "eager",
                         gqa="?", q=None, k=None, v=None, output=node, chain=[]).skip(reason)


def _check_consistent(sites: list[AttentionSite], state, before: int) -> None:
    """A site whose cache lives in the pool (rewritten in an earlier graph) cannot run as it
    was in this one: its past keys and values are not in the model's cache object."""
    earlier = {r.name: r for r in state.records[:before] if r.rewritten and r.cache != "none"}
    for s in sites:
        rec = earlier.get(s.name)
        if rec is not None and not s.rewritten:
            raise CacheStateError(
                f"attention site {s.name} was rewritten in graph {rec.graph} (its cache is in "
                f"kvcompile's pool) but cannot be in this graph: {s.reason or 'disabled'}. "
                f"Call the model the same way throughout (grad mode, output_attentions), or "
                f"configure(module, enabled=False) before the first call")


# Attributes Dynamo sets on placeholder nodes themselves (not in meta), which a deep copy of
# the graph drops and AOTAutograd asserts on ("node ... must have _dynamo_source attribute")
_PLACEHOLDER_ATTRS = ("_dynamo_source",)


def _restore(gm: fx.GraphModule, pristine: fx.Graph | None) -> None:
    if pristine is not None:
        kept = {n.name: {a: getattr(n, a) for a in _PLACEHOLDER_ATTRS if hasattr(n, a)}
                for n in gm.graph.find_nodes(op="placeholder")}
        gm.graph = copy.deepcopy(pristine, {})
        for n in gm.graph.find_nodes(op="placeholder"):
            for a, v in kept.get(n.name, {}).items():
                setattr(n, a, v)
        gm.recompile()


def _leave_all_alone(gm, pristine, state, reason: str) -> PipelineResult:
    """The graph as it came, every site found in it left alone with `reason`."""
    res = PipelineResult(plan=RewritePlan())
    sites = []
    for node in candidates(gm):
        try:
            found = match_attention(node)
        except Exception:  # noqa: BLE001
            found = _failed_site(node, reason)
        if isinstance(found, AttentionSite):
            sites.append(found.skip(found.reason or reason))
    name_sites(sites)
    res.plan.sites = sites
    res.logs.append(PassLog("find_attention", f"left as it was: {reason}"))
    notices.warn_once(state, ("graph", reason),
                      f"kvcompile left a graph of {notices.model_name(state)} as it was: "
                      f"{reason}")
    run = _Run(gm, [], state, False, None, {}, False)
    run.res = res
    return run.commit()


class _Checkpoint:
    """What a failed run may have added to the model's state, to take back before a retry."""

    def __init__(self, state):
        self.n = len(state.layer_specs)
        self.names = dict(state.layer_names)
        self.pool = state.pool
        ev = getattr(state, "eviction", None)
        self.eviction = ev
        self.policies = dict(ev.policies) if ev is not None else None

    def restore(self, state) -> None:
        if len(state.layer_specs) > self.n:
            del state.layer_specs[self.n:]
            del state.layer_meta[self.n:]
            state.layer_names.clear()
            state.layer_names.update(self.names)
            if state.pool is None:
                state.pool = self.pool  # built for the layers we keep
        ev = getattr(state, "eviction", None)
        if ev is not None and self.eviction is None:   # made by the failed run: drop it
            state.eviction = None
            state.hooks[:] = [h for h in state.hooks if h is not ev]
        elif ev is not None:
            ev.policies.clear()
            ev.policies.update(self.policies or {})


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else '(no message)'}"


def _needs_grad(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
