"""Spec tests: one thread (tiny ops on 2 shared cores) and a random tiny model with MTP."""

from __future__ import annotations

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.model.tiny import random_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def mtp_model():
    return random_model(tiny_config(), seed=5)
