"""``nexuskv.cost-models``: fitted cost-model entries published by the calibration agent.

Keyed by entry id (:attr:`CostModelEntry.key`): ``compute/<model>/<profile>`` for a
``T_compute(e, s) = c0 + c1*e + c2*e*s`` fit, ``overhead/<model>/<profile>`` for the fixed per-request cost outside the forward pass
(``o0 + o1*prompt_tokens``), ``link/<profile>/<source>-><destination>/<page
bytes>B`` for a ``T_transfer = latency + pages*per_page + bytes*seconds_per_byte`` fit of copies
whose pages were that many bytes (a fit of one block size is valid at that size only: its pages
and bytes grow in fixed proportion; an entry without ``page_bytes``, as published before the
field existed, is keyed without the suffix and taken as valid at any size). Each record is the whole
posterior of one entry: the parameter mean (in that order), its covariance (seconds² per
feature²), the residual standard deviation of one observation (relative to the prediction: the
fit weights observations by their size), how many observations it has seen and a version that
grows with every publication. A planner keeps the latest record per key over its shipped
profiles (:func:`nexuskv.calibration.apply_entry`); since each record is complete, the topic can
be compacted.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from nexuskv.contract import Contract
from nexuskv.descriptor import Tier

__all__ = ["SCHEMA_VERSION", "ComputeFit", "LinkFit", "OverheadFit", "CostModelEntry", "link_entry_id"]

SCHEMA_VERSION = 1
Text = Annotated[str, Field(min_length=1, max_length=512)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Vec3 = tuple[Finite, Finite, Finite]


class ComputeFit(Contract):
    kind: Literal["compute"] = "compute"
    model: Text
    profile: Text


class OverheadFit(Contract):
    """The fixed per-request cost outside the forward pass: ``o0 + o1 * prompt_tokens`` (third term 0)."""

    kind: Literal["overhead"] = "overhead"
    model: Text
    profile: Text


class LinkFit(Contract):
    kind: Literal["link"] = "link"
    profile: Text
    source_tier: Tier
    destination_tier: Tier
    page_bytes: Annotated[int, Field(ge=1)] | None = None  # bytes of one copied page the fit holds for


Fit = Annotated[Union[ComputeFit, LinkFit, OverheadFit], Field(discriminator="kind")]


class CostModelEntry(Contract):
    schema_version: Annotated[int, Field(ge=1, le=1)] = SCHEMA_VERSION
    entry: Fit
    mean: Vec3
    cov: tuple[Vec3, Vec3, Vec3]
    residual_rel_std: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    observations: Annotated[int, Field(ge=1)]
    version: Annotated[int, Field(ge=1)]
    fitted_at: Annotated[float, Field(ge=0)]  # seconds since the epoch
    publisher: Text
    method: Text  # e.g. "weighted RLS, forgetting 0.999"

    @model_validator(mode="after")
    def _covariance(self) -> CostModelEntry:
        for i in range(3):
            if self.mean[i] < 0:  # every term is a cost: a fit publishes its non-negative projection
                raise ValueError(f"mean: parameter {i} is negative ({self.mean[i]})")
        for i in range(3):
            if self.cov[i][i] < 0:
                raise ValueError(f"cov: variance {i} is negative")
            for j in range(i):
                a, b = self.cov[i][j], self.cov[j][i]
                if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-300):
                    raise ValueError("cov: must be symmetric")
        return self

    @property
    def key(self) -> str:
        e = self.entry
        if isinstance(e, ComputeFit):
            return f"compute/{e.model}/{e.profile}"
        if isinstance(e, OverheadFit):
            return f"overhead/{e.model}/{e.profile}"
        return link_entry_id(e.profile, e.source_tier, e.destination_tier, e.page_bytes)


def link_entry_id(profile: str, source: Tier, destination: Tier, page_bytes: int | None) -> str:
    """The entry id of a link fit (one spelling for the calibration agent and every reader)."""
    base = f"link/{profile}/{source.value}->{destination.value}"
    return base if page_bytes is None else f"{base}/{page_bytes}B"
