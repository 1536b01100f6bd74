"""The one thread policy (scratchlm/threads.py) and the --threads flag on every command that runs torch."""

from __future__ import annotations

import argparse

import pytest

from scratchlm import cli
from scratchlm.threads import choose_threads, physical_cores

CPUINFO_SMT = "\n\n".join(  # 2 physical cores x 2 hyper-threads
    f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {core}\nsiblings\t: 4\ncpu cores\t: 2"
    for cpu, core in [(0, 0), (1, 1), (2, 0), (3, 1)]
)


def test_physical_cores_counts_smt_siblings_once_and_respects_affinity():
    assert physical_cores({0, 1, 2, 3}, CPUINFO_SMT) == 2
    assert physical_cores({0, 2}, CPUINFO_SMT) == 1  # pinned to both threads of one core
    assert physical_cores({0, 1}, "") == 2  # no usable cpuinfo: count the logical CPUs
    assert physical_cores() >= 1


@pytest.mark.parametrize("cores, load, world, want", [
    (8, 0.0, 1, 8),    # idle machine: every physical core (torch's own default)
    (8, 3.4, 1, 5),    # 3 cores busy elsewhere
    (8, 0.0, 2, 4),    # two ranks share the cores
    (8, 5.0, 2, 1),    # 3 free cores over 2 ranks
    (2, 0.83, 1, 1),   # a core 80 % busy is not free (round half up)
    (2, 0.4, 1, 2),
    (2, 7.0, 1, 1),    # overloaded: never below one
    (2, 0.0, 4, 1),    # more ranks than cores: one each
])
def test_default_is_free_cores_per_rank(cores, load, world, want):
    choice = choose_threads(world_size=world, cores=cores, load=load, env={})
    assert choice.threads == want
    assert f"load {load:.2f}" in choice.reason


def test_explicit_and_env_take_precedence():
    assert choose_threads(3, cores=2, load=9.0, env={"OMP_NUM_THREADS": "5"}).threads == 3
    choice = choose_threads(cores=8, load=0.0, env={"OMP_NUM_THREADS": "5"})
    assert (choice.threads, choice.reason) == (5, "OMP_NUM_THREADS")
    assert str(choose_threads(3)) == "3 torch threads (--threads)"


def test_torchrun_local_world_size_counts_the_ranks_on_this_machine():
    # 2 nodes x 1 rank (world 2): each rank has the node's free cores; 4 ranks on one node share them
    assert choose_threads(world_size=2, cores=8, load=0.0, env={"LOCAL_WORLD_SIZE": "1"}).threads == 8
    assert choose_threads(world_size=4, cores=8, load=0.0, env={"LOCAL_WORLD_SIZE": "4"}).threads == 2


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_requests_are_clear_errors(bad):
    with pytest.raises(ValueError, match="expected a positive integer"):
        choose_threads(bad)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        choose_threads(env={"OMP_NUM_THREADS": "many"})


@pytest.mark.parametrize("name", ["serve", "chat", "generate", "train"])
def test_every_command_has_threads(name):
    parser = cli.build_parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    action = next((a for a in sub._actions if "--threads" in a.option_strings), None)
    assert action is not None, f"scratchlm {name} has no --threads"
    args = parser.parse_args([name, "--threads", "3"] + (["x"] if name == "generate" else []))
    assert args.threads == 3


def test_apply_logs_the_choice(caplog):
    import logging

    import torch

    from scratchlm.threads import apply_threads

    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="scratchlm.threads"):
            choice = apply_threads(1)
        assert torch.get_num_threads() == 1 and choice.threads == 1
        assert "using 1 torch thread (--threads)" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_library_entry_keeps_a_count_the_caller_set(monkeypatch):
    import torch

    import scratchlm.threads as threads

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "physical_cores", lambda *a, **k: 4)  # torch's start-up default here: 4
    try:
        torch.set_num_threads(3)  # the host program chose 3
        kept = threads.apply_threads(keep_caller_setting=True, env={}, cores=4, load=0.0)
        assert (kept.threads, torch.get_num_threads()) == (3, 3) and "caller" in kept.reason
        torch.set_num_threads(4)  # still torch's default: the policy applies
        assert threads.apply_threads(keep_caller_setting=True, env={}, cores=4, load=2.0).threads == 2
        assert threads.apply_threads(1, keep_caller_setting=True).threads == 1  # an explicit request wins
    finally:
        torch.set_num_threads(before)
