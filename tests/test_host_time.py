"""bench.host_time splits a real engine's decode steps into their host parts."""

from __future__ import annotations

from superinfer.bench.host_time import measure


def test_a_decode_step_splits_into_schedule_update_outputs_and_the_model():
    parts = measure(batch=4, steps=3, detokenize=True)
    assert set(parts) == {"schedule", "update", "outputs", "model", "inputs", "attention"}
    assert all(ms > 0 for ms in parts.values()), parts  # each part ran in every timed step
    assert parts["model"] > parts["schedule"]  # a forward pass outweighs planning 4 decodes
    assert parts["model"] > parts["inputs"] + parts["attention"]  # the runner's host work is inside the model step
