"""The tests' single-process reference and labkit's are one (issue 61, item 5): helpers'
reference_state, which the equivalence, method and PS-variant tests compare runs under
torchrun with, trains the same model as labkit.training.instruments.exactness.reference_state (what
`labkit check` holds a method of one's own to), bit for bit, on TINY's settings."""
from __future__ import annotations

import pytest
import torch

from helpers import STEPS, reference_config, reference_state
from labkit.training.instruments import exactness

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("trainers", [1, 2])
def test_the_tests_reference_is_labkits(trainers):
    ours = reference_state(trainers)
    labkits = exactness.reference_state(reference_config(), trainers, STEPS)
    assert set(ours) == set(labkits)
    assert [k for k in ours if not torch.equal(ours[k], labkits[k])] == []
    # and it trained: the weights are not the initial ones
    torch.manual_seed(reference_config().seed)
    from labkit.workloads.images.models import build_model
    init, _ = build_model("resnet10_small", 10)
    assert any(not torch.equal(v, ours[k]) for k, v in init.state_dict().items()
               if v.is_floating_point())
