"""One colour per kind of work, shared by the graph, the timeline and their legends.

Colours follow the PipeFisher figures' spirit (forward and backward in blues and greens,
K-FAC work in warm colours) and stay distinguishable in greyscale print order.
"""

from __future__ import annotations

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
# how a picture's title names each optimizer's work
OPTIMIZER_TITLES = {"kfac": "K-FAC", "shampoo": "Shampoo", "muon": "Muon", "adamw": "AdamW"}


def group_of(kind: str) -> str:
    return _GROUP_OF_KIND[kind]


def color_of(kind: str) -> str:
    return GROUPS[group_of(kind)][1]


def label_of(group: str) -> str:
    return GROUPS[group][0]
