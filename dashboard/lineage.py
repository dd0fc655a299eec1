"""A job's checkpoint lineage drawn as ``git log --graph`` draws history: a list, not a staircase.

The tree (``checkpoints.services.lineage_tree``) nests every checkpoint under its parent, so a job
that simply ran was drawn as a staircase, one level deeper per checkpoint. Here it becomes rows,
newest first: a chain of checkpoints stays in its lane, and only a branch (a rollback started a
new line from an older checkpoint) moves one lane right, listed above the checkpoint it forked
from, its first row marked as the fork. A row is never deeper than the number of forks between it
and the root. The chain that recovery follows (the active path) is the lane 0 chain wherever the
tree allows: at each fork the child on the active path continues the lane.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpoints.services import lineage_tree

#: Rows shown before the rest is folded behind "show older".
VISIBLE_ROWS = 12


@dataclass(frozen=True)
class Row:
    node: object  # checkpoints.services.registry.TreeNode
    depth: int
    fork_of: int | None  # the step this branch started from, on a branch's oldest row


def rows(job) -> dict:
    """The lineage as rows (``visible`` then ``older``), with the tree's facts for the template."""
    tree = lineage_tree(job)
    newest = _newest_steps(tree.roots)
    out: list[Row] = []
    for root in sorted(tree.roots, key=lambda n: newest[id(n)], reverse=True):
        out += _lane(root, newest, depth=0, fork_of=None)
    return {"visible": out[:VISIBLE_ROWS], "older": out[VISIBLE_ROWS:], "tree": tree,
            "depth": max((row.depth for row in out), default=0)}


def _lane(start, newest: dict[int, int], *, depth: int, fork_of: int | None) -> list[Row]:
    """The chain from ``start`` (following the active child, else the newest), newest first, each
    side branch's rows just above the checkpoint it forked from. Recurses per fork, not per row."""
    chain = [start]
    while chain[-1].children:
        children = chain[-1].children
        chain.append(next((c for c in children if c.on_active_branch), None)
                     or max(children, key=lambda n: newest[id(n)]))
    out: list[Row] = []
    for i in range(len(chain) - 1, -1, -1):
        node = chain[i]
        following = chain[i + 1] if i + 1 < len(chain) else None
        sides = sorted((c for c in node.children if c is not following), key=lambda n: newest[id(n)], reverse=True)
        for side in sides:
            out += _lane(side, newest, depth=depth + 1, fork_of=node.checkpoint.step)
        out.append(Row(node, depth, fork_of if i == 0 else None))
    return out


def _newest_steps(roots) -> dict[int, int]:
    """The newest step under each node (itself included), by ``id(node)``: children first, without
    recursion (a chain is as long as the job has checkpoints)."""
    order, stack = [], list(roots)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children)
    newest: dict[int, int] = {}
    for node in reversed(order):
        newest[id(node)] = max([node.checkpoint.step, *(newest[id(c)] for c in node.children)])
    return newest
