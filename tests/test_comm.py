"""The runtime's choices in talking to other ranks that no end-to-end result shows: the
order it posts receives in, and which group its posted collectives use."""

from datetime import timedelta

import torch

from runtime.pipeline.comm import World, control_group
from runtime.pipeline.interpreter import posting_order


def test_receives_are_posted_last_needed_first_only_where_tags_match_them():
    step = ["RA0.0", "RA0.1", "RG1.0", "RA0.2"]
    # tags: each receive matches its own send, and the first one needed goes last
    assert posting_order(step, tags=True) == ["RA0.2", "RG1.0", "RA0.1", "RA0.0"]
    # no tags (NCCL's rule on gloo): a pair matches in issue order, so the plan's order stays
    assert posting_order(step, tags=False) == step
    assert step == ["RA0.0", "RA0.1", "RG1.0", "RA0.2"]  # the caller's list is left as it was


def test_only_gloo_jobs_of_several_ranks_get_a_control_group():
    # NCCL keeps point-to-point and collectives on separate communicators; one rank has no peer.
    # Neither call may create a group (no process group exists in this process).
    for backend, size in (("nccl", 2), ("gloo", 1)):
        world = World(0, size, 0, torch.device("cpu"), backend, timedelta(seconds=5))
        assert control_group(world) is None
