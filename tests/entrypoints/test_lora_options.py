"""A LoRA load's options travel as one object (protocol/lora_options.py): the HTTP body's fields
become it, and a field added there reaches the body, the upload's query string and the load."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from diffusion_rollout.entrypoints.routers import lora as lora_router
from diffusion_rollout.protocol.lora_options import LoraLoadFields, LoraLoadOptions


def test_the_body_carries_every_load_option_and_hands_them_over_as_one_frozen_object():
    assert set(LoraLoadFields.model_fields) <= set(lora_router.LoraLoadRequest.model_fields)
    assert set(LoraLoadFields.model_fields) <= lora_router._UPLOAD_QUERY  # the octet-stream form too
    body = lora_router.LoraLoadRequest(name="a", path="/x", lora_alpha=8, activate=True, strength=0.5)
    options = body.load_options()
    assert options == LoraLoadOptions(lora_alpha=8.0, activate=True, mode=None, strength=0.5)
    with pytest.raises(ValidationError):
        options.strength = 1.0  # one load's options never change on the way
    assert pickle.loads(pickle.dumps(options)) == options  # as the cluster hands it to its replicas


def test_only_a_load_that_sets_something_changes_the_active_adapter():
    assert not LoraLoadOptions().changes_active()
    assert not LoraLoadOptions(lora_alpha=4).changes_active()
    for change in ({"activate": True}, {"mode": "merged"}, {"strength": 0.0}):
        assert LoraLoadOptions(**change).changes_active(), change


@pytest.mark.parametrize("bad", [{"lora_alpha": 0}, {"mode": "fused"}, {"sideways": 1}])
def test_a_bad_option_is_refused_naming_it(bad):
    with pytest.raises(ValidationError, match=next(iter(bad))):
        LoraLoadOptions(**bad)
