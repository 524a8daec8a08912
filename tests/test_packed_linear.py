"""Linear layers on oneDNN's packed weights (CPU, float32): the same results, and really used."""

from __future__ import annotations

import pytest
import torch

from superinfer.engine.core.request import SamplingParams
from superinfer.engine.model import DecoderLM, load_model
from superinfer.engine.model.packed_linear import Linear, pack_linears, why_not_packed
from tests.test_engine import engine
from tests.test_model import _our_logits

pytestmark = pytest.mark.skipif(
    why_not_packed(torch.zeros(1)) is not None, reason="this torch build has no oneDNN linear"
)


def _tiny(dtype: str = "float32") -> DecoderLM:
    return load_model("tiny", dtype=dtype).model


def _logits(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    return _our_logits(model, [ids])


def test_packed_model_gives_the_dense_models_logits_and_runs_on_the_packed_weights() -> None:
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    dense = _logits(model, ids)
    added = pack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed is not None for m in layers)
    assert added == sum(m.weight.numel() * 4 for m in layers)
    packed = _logits(model, ids)
    torch.testing.assert_close(packed, dense, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        for m in layers:
            m.weight.zero_()  # the dense weights are no longer read
    torch.testing.assert_close(_logits(model, ids), packed)


def test_other_dtypes_keep_torch_matmul() -> None:
    model = _tiny("bfloat16")
    assert pack_linears(model) == 0
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    assert "bfloat16" in (why_not_packed(torch.zeros(1, dtype=torch.bfloat16)) or "")


def test_a_packed_layer_adds_its_bias_and_matmul_leaves_it_out() -> None:
    layer = Linear(24, 40, bias=True)
    x = torch.randn(5, 24)
    assert pack_linears(torch.nn.Sequential(layer)) == 24 * 40 * 4 and layer.packed is not None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(layer.matmul(x), x @ layer.weight.T)


def test_the_engine_packs_by_default_and_cpu_linear_torch_keeps_the_dense_matmul() -> None:
    outputs = {}
    for choice in ("onednn", "torch"):
        core = engine("tiny", engine_process=False, cpu_linear=choice)
        layers = [m for m in core.runner.model.modules() if isinstance(m, Linear)]
        assert all((m.packed is not None) == (choice == "onednn") for m in layers)
        core.add_request("r", list(range(5, 40)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens: list[int] = []
        while core.has_work:
            tokens += [t for out in core.step() for t in out.token_ids]
        outputs[choice] = tokens
        core.close()
    assert len(outputs["onednn"]) == 12 and outputs["onednn"] == outputs["torch"]
