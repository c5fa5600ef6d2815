"""Where the model is cut into pipeline stages: the cuts that need no planning.

A partition lists, per model stage, the profile's parts it runs ([["embed", "block0"],
["block1", "head"]]); every part once, in order. Its text form, as `--partition` takes it
and `inspect` prints it, is "embed,block0|block1,head".

- `compute`: the cut that minimises the slowest stage's forward + backward time (a dynamic
  programme over the parts; the compute-only partition of torchtitan's and PyTorch's
  auto-partitioning proposals). The default.
- `even`: each stage the same number of middle parts (blocks), the first part (the
  embedding) with the first stage and the last (the head) with the last; torchtitan's
  default cut, blind to what the parts cost.
- `auto`: the cut chosen with the plan, the optimizer's work and the memory limit counted
  (pfcompile.place.partition).
"""

from __future__ import annotations

from pfcompile.formats.errors import InputError, echo
from pfcompile.formats.profile import Profile

RULES = ("compute", "even", "auto")


def parse_partition(text: str, profile: Profile, stages: int, where: str = "--partition") -> list[list[str]]:
    """"embed,block0|block1,head" -> [["embed", "block0"], ["block1", "head"]], checked."""
    cut = [[p.strip() for p in group.split(",") if p.strip()] for group in text.split("|")]
    return check_partition(cut, profile, stages, where)


def format_partition(cut: list[list[str]]) -> str:
    """The text form: stages joined by "|", parts by ","."""
    return "|".join(",".join(group) for group in cut)


def check_partition(cut: list[list[str]], profile: Profile, stages: int, where: str = "partition") -> list[list[str]]:
    names = [p.name for p in profile.parts]
    flat = [p for group in cut for p in group]
    if any(not group for group in cut):
        raise InputError(where, None, "every stage needs at least one part")
    unknown = [p for p in flat if p not in names]
    if unknown:
        raise InputError(where, None, f"names no part of the profile: {echo(unknown[0])} (parts: {echo(names[0])}..{echo(names[-1])})")
    if flat != names:
        raise InputError(where, None, f"must list every part of the profile once, in order ({names[0]}..{names[-1]})")
    if len(cut) != stages:
        raise InputError(where, None, f"has {len(cut)} stages but the configuration needs {stages}")
    return cut


def cut_at(profile: Profile, bounds: tuple[int, ...]) -> list[list[str]]:
    """The partition whose stage s holds parts bounds[s-1] .. bounds[s]-1 (bounds: the
    indices where stages 1.. start, ascending)."""
    names = [p.name for p in profile.parts]
    edges = (0, *bounds, len(names))
    return [names[a:b] for a, b in zip(edges, edges[1:])]


def bounds_of(profile: Profile, cut: list[list[str]]) -> tuple[int, ...]:
    """The inverse of cut_at."""
    out, n = [], 0
    for group in cut[:-1]:
        n += len(group)
        out.append(n)
    return tuple(out)


def compute_partition(profile: Profile, stages: int) -> list[list[str]]:
    """Cut the parts into `stages` contiguous groups minimising the slowest group's fwd+bwd.

    Dynamic programme over (parts used, stages made); ties prefer the smaller sum of squared
    stage costs so that equal blocks split evenly (3+3+3 rather than 2+3+4).
    """
    parts = profile.parts
    n = len(parts)
    if stages > n:
        raise InputError("--stages", None, f"{stages} model stages but the profile has only {n} parts")
    cost = [p.fwd_ms + p.bwd_ms for p in parts]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (max stage cost, sum of squares) for the first i parts in j stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut_from = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, stages + 1):
        for i in range(j, n - (stages - j) + 1):
            for h in range(j - 1, i):
                prev = best[j - 1][h]
                if prev == inf:
                    continue
                c = prefix[i] - prefix[h]
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[j][i]:
                    best[j][i], cut_from[j][i] = cand, h
    groups, i = [], n
    for j in range(stages, 0, -1):
        h = cut_from[j][i]
        groups.append([p.name for p in parts[h:i]])
        i = h
    return groups[::-1]


def even_partition(profile: Profile, stages: int) -> list[list[str]]:
    """The middle parts divided evenly (the first stages take one more where they do not
    divide), the first part with the first stage, the last with the last."""
    names = [p.name for p in profile.parts]
    middle = names[1:-1]
    if stages == 1:
        return [names]
    if len(middle) < stages:
        raise InputError("--partition", None, f"even: {len(middle)} blocks cannot give each of {stages} stages one")
    per, extra = divmod(len(middle), stages)
    cut, i = [], 0
    for s in range(stages):
        n = per + (s < extra)
        cut.append(middle[i:i + n])
        i += n
    cut[0].insert(0, names[0])
    cut[-1].append(names[-1])
    return cut


def partition_by_rule(rule: str, profile: Profile, stages: int) -> list[list[str]]:
    """The cut of a rule that needs no planning ("compute" or "even")."""
    if rule == "compute":
        return compute_partition(profile, stages)
    if rule == "even":
        return even_partition(profile, stages)
    raise ValueError(f"the {rule!r} cut is chosen by planning (pfcompile.place.partition)")


def stage_partition(profile: Profile, cfg) -> list[list[str]]:
    """The partition a configuration plans with: its own, checked, or the compute cut."""
    if cfg.partition is not None:
        return check_partition(cfg.partition, profile, cfg.num_stages)
    return compute_partition(profile, cfg.num_stages)
