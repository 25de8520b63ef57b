"""resolve_config for one site: its KVConfig (overrides applied), its K/V storage formats and
the pool layer it will get; and what to say when a format cannot hold a site.

A format that cannot store a site's shape (fp4 / int3 with head_dim 20, "auto" for a float64
model) is a FormatProblem: the pipeline leaves that site alone with a warning naming the field
and the formats that fit, or, when no site of the model can be stored, raises KVConfigError.
"""

from __future__ import annotations

import torch

from kvcompile.errors import KVConfigError
from kvcompile.passes import notices
from kvcompile.passes.site_config import resolve_site_config
from kvcompile.passes.sites import AttentionSite


class FormatProblem(Exception):
    """A site's config names a storage format that cannot hold it."""

    def __init__(self, field_name: str, value, reason: str, fits: list[str]):
        super().__init__(reason)
        self.field, self.value, self.reason, self.fits = field_name, value, reason, fits


def configure_site(site: AttentionSite, state, scope) -> None:
    """resolve_config for one site: its KVConfig (overrides applied), its K/V storage formats,
    and its layer in the pool. FormatProblem if a format cannot hold the site."""
    from kvcompile.cache.pool import LayerSpec

    resolve_site_config(site, state.config, scope)
    if not site.config.enabled:
        return
    cfg = site.config
    if site.latent is not None and _latent_refusal(site, state):
        return
    kf = _format(cfg, "k", site.dtype, site.head_dim, state.config.page_size)
    vf = _format(cfg, "v", site.dtype, site.v_head_dim, state.config.page_size)
    site.k_format_name, site.v_format_name = kf.name, vf.name
    # the layer joins the pool once the site is rewritten (_Run.go)
    site.layer_spec = LayerSpec(num_kv_heads=site.num_kv_heads, head_dim=site.head_dim,
                                v_head_dim=site.v_head_dim, k_format=kf, v_format=vf)
    site.layer_meta = {"name": site.name, "k_format": kf.name, "v_format": vf.name,
                       "eviction": cfg.eviction, "rotate": cfg.rotate,
                       "latent": site.latent is not None}


def _latent_refusal(site: AttentionSite, state) -> bool:
    """An MLA site whose config asks for what latent pages do not do yet is left alone, and
    says so once."""
    cfg = site.config
    field_name = "rotate" if cfg.rotate == "hadamard" else ""
    if not field_name:
        return False
    site.skip(f"MLA: KVConfig.{field_name}={getattr(cfg, field_name)!r} is not supported on "
              f"latent pages")
    notices.warn_once(state, ("latent", site.name),
                      f"kvcompile left attention site {site.name} of "
                      f"{notices.model_name(state)} alone: {site.reason}; give it "
                      f"kvcompile.configure(module, {field_name}=None) to page its latent")
    return True


_AUTO = (torch.bfloat16, torch.float16, torch.float32)


def _format(cfg, which: str, model_dtype, head_dim: int, page_size: int):
    from kvcompile.cache.formats import resolve_format

    name = cfg.key_dtype if which == "k" else cfg.value_dtype
    gran = cfg.scale_granularity if which == "k" else cfg.value_granularity
    field_name = f"{which}_dtype" if getattr(cfg, f"{which}_dtype") else "kv_dtype"
    if name == "auto" and model_dtype not in _AUTO:
        raise FormatProblem(field_name, name, f"the model computes in {model_dtype}, which has "
                            f"no storage format of its own", _fits(model_dtype, gran, head_dim,
                                                                  page_size))
    fmt = resolve_format(name, model_dtype, gran, cfg.static_scale, cfg.residual)
    try:
        fmt.check_shape(head_dim, page_size)
    except ValueError as e:
        raise FormatProblem(field_name, name, str(e).split("; use ")[0],
                            _fits(model_dtype, gran, head_dim, page_size)) from e
    return fmt


def _fits(model_dtype, gran: str, head_dim: int, page_size: int) -> list[str]:
    """The storage formats that hold a site of this head_dim at this page size."""
    from kvcompile.cache.formats import KVFormat
    from kvcompile.cache.registry import format_names, format_spec

    out = []
    for name in format_names():
        takes = format_spec(name).granularities
        g = "page" if not takes else gran if gran in takes else takes[0]
        try:
            KVFormat(name, g).check_shape(head_dim, page_size)
        except ValueError:
            continue
        out.append(name)
    return out


def pick(fits: list[str]) -> str:
    for name in ("fp8_e4m3", "int4", "bf16", "fp32"):
        if name in fits:
            return name
    return fits[0] if fits else "bf16"


def quoted(fits: list[str]) -> str:
    return ", ".join(repr(f) for f in fits) or "none"


def refusal(refused: list, state) -> KVConfigError:
    """No site of the model can be stored as configured: refuse the config, by name."""
    _, p = refused[0]
    where = ", ".join(s.name for s, _ in refused[:3]) + (", ..." if len(refused) > 3 else "")
    fix = "fp32" if p.value == "auto" and "fp32" in p.fits else pick(p.fits)
    return KVConfigError(p.field, p.value, f"a format that fits this model: {quoted(p.fits)}",
                         hint=f"{p.reason}, at every attention site of "
                              f"{notices.model_name(state)} ({len(refused)}: {where}), so "
                              f"nothing would be compiled; e.g. KVConfig({p.field}={fix!r}).")
