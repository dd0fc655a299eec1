"""Choosing nodes for a generation. Pure: candidates in, an ordered choice out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    hostname: str
    is_spare: bool
    ran_previous: bool  # ran the job's previous generation (warm caches, known good)


@dataclass(frozen=True)
class Placement:
    hostnames: tuple[str, ...]
    shrunk: bool = False  # fewer nodes than the job asked for

    @property
    def ok(self) -> bool:
        return bool(self.hostnames)


def place(candidates: list[Candidate], *, nnodes: int, allow_shrink: bool) -> Placement:
    """Pick ``nnodes`` healthy nodes: previous ones first, then regular nodes, spares last.

    With too few, and a policy that allows it, run on what there is (the hooks keep the global
    sample order exact on a smaller world); otherwise place nothing.
    """
    ranked = sorted(candidates, key=lambda c: (not c.ran_previous, c.is_spare, c.hostname))
    chosen = tuple(c.hostname for c in ranked[:nnodes])
    if len(chosen) == nnodes:
        return Placement(chosen)
    if allow_shrink and chosen:
        return Placement(chosen, shrunk=True)
    return Placement(())
