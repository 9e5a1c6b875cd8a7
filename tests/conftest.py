"""Shared fixtures: tiny offline checkpoints and synthetic datasets, built once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory):
    from data_tools.make_tiny_model import build_vl_model

    return str(build_vl_model(tmp_path_factory.mktemp("tiny_vl"), warmup_steps=0))


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    from data_tools.make_tiny_model import build_text_model

    return str(build_text_model(tmp_path_factory.mktemp("tiny_text"), warmup_steps=0))


@pytest.fixture(scope="session")
def colour_data(tmp_path_factory):
    from data_tools.synth_shapes import write_colour_task

    out = tmp_path_factory.mktemp("colours")
    write_colour_task(out, n_train=48, n_test=8, seed=0)
    return out


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory):
    from data_tools.synth_shapes import write_addition_task

    out = tmp_path_factory.mktemp("addition")
    write_addition_task(out, n_train=48, n_test=8, seed=0)
    return out


@pytest.fixture(scope="session")
def world_of_one():
    """A one-rank gloo process group, as a plain `python` run of the trainer creates."""
    from vlrft.trainer.distributed import init_distributed

    return init_distributed()
