"""Recomputation policies: which tokens are recomputed with full causal attention."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    """`none`: pure span semantics, nothing recomputed. `full`: everything read causally, exactly a
    plain prompt of the same tokens. Selective policies subclass this."""

    name: str = "none"

    @property
    def reads_causally(self) -> bool:
        return self.name == "full"


NONE = Policy("none")
FULL = Policy("full")
_BY_NAME = {"none": NONE, "full": FULL}


def resolve_policy(policy: "str | Policy | None", default: Policy = NONE) -> Policy:
    if policy is None:
        return default
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in _BY_NAME:
        return _BY_NAME[policy]
    raise ValueError(f"unknown recomputation policy {policy!r}; use one of {sorted(_BY_NAME)} or a Policy object")
