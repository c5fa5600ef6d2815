"""One colour per kind of work, shared by the graph, the timeline and their legends.

Colours follow the PipeFisher figures' spirit (forward and backward in blues and greens,
K-FAC work in warm colours) and stay distinguishable in greyscale print order. An op kind
of an optimizer declared elsewhere that has no group here is drawn as its declaration says
(`OpDecl.render`), or in a neutral grey under its kind's name.
"""

from __future__ import annotations

from pfcompile.formats.optimizers import OPTIMIZERS, OpDecl, optimizer

# group -> (legend label, fill colour)
GROUPS: dict[str, tuple[str, str]] = {
    "fwd": ("forward", "#4e79a7"),
    "bwd": ("backward", "#59a14f"),
    "bwd_weight": ("weight gradient (W)", "#8cd17d"),
    "curv": ("curvature", "#f28e2b"),
    "stats": ("statistics (Shampoo)", "#ff9d9a"),
    "inv": ("inversion / inverse root", "#e15759"),
    "sync_curv": ("factor sync", "#b07aa1"),
    "sync_grad": ("gradient sync", "#9c755f"),
    "precond": ("preconditioning", "#edc948"),
    "orth": ("orthogonalisation (Muon)", "#d4a6c8"),
    "step": ("optimizer step", "#76b7b2"),
    "p2p": ("send/recv", "#bab0ac"),
}

_GROUP_OF_KIND = {
    "fwd": "fwd", "bwd": "bwd", "bwd_input": "bwd", "bwd_weight": "bwd_weight",
    "send_act": "p2p", "recv_act": "p2p", "send_grad": "p2p", "recv_grad": "p2p",
    "curv_a": "curv", "curv_b": "curv",
    "sync_curv": "sync_curv", "bcast_inv": "sync_curv",
    "inv": "inv", "sync_grad": "sync_grad", "rs_grad": "sync_grad", "ag_grad": "sync_grad",
    "precond": "precond", "stats": "stats", "orth": "orth", "step": "step",
}
# the fill of an optimizer's op kind that has no group here and declares no `render` of its own
FALLBACK_COLOUR = "#79706e"


def _declared(kind: str) -> OpDecl | None:
    """The declaration of `kind` in any declared optimizer (read at call time)."""
    return next((d for o in OPTIMIZERS.values() for d in o.ops if d.kind == kind), None)


def group_of(kind: str) -> str:
    """The kind's group; an optimizer's kind with none here is a group of its own."""
    if kind in _GROUP_OF_KIND:
        return _GROUP_OF_KIND[kind]
    if _declared(kind) is not None:
        return kind
    raise ValueError(f"no colour for op kind {kind!r}: not a pass, a message or a declared optimizer's op")


def style_of(group: str) -> tuple[str, str]:
    """(legend label, fill colour) of a group: ours, else the declared op's `render`, else its
    kind's name in FALLBACK_COLOUR."""
    if group in GROUPS:
        return GROUPS[group]
    d = _declared(group)
    return d.render if d is not None and d.render is not None else (group, FALLBACK_COLOUR)


def legend_groups(present) -> list[str]:
    """The groups of `present` in legend order: ours as GROUPS lists them, then the others."""
    return [g for g in GROUPS if g in present] + sorted(g for g in present if g not in GROUPS)


def color_of(kind: str) -> str:
    return style_of(group_of(kind))[1]


def label_of(group: str) -> str:
    return style_of(group)[0]


def optimizer_title(name: str) -> str:
    """How a picture's title names the optimizer's work (its declaration's title)."""
    return optimizer(name).label
