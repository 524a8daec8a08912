"""Step and copy costs for the simulator, as `StepCost`s that `DeviceTimeline` places on lanes.

Roofline: a step streams the weights it uses and the KV its sequences attend to from HBM, and
computes 2 x active parameters FLOPs per token plus attention; it takes the longer of the two at
the profile's achieved rates, plus a fixed launch cost. A block copy takes its bytes over the host
link: with full duplex both directions usually run at once (eager write-through keeps copy-out
busy while copy-in brings rotary requests back), so each gets half the link's both-ways rate;
half duplex and serial copies run one direction at a time at the one-way rate.

A calibration file (measured on a device, or fitted from the engine's own step-time model)
replaces the roofline with a linear cost: fixed + per token + per sequence + per thousand context
tokens, each step scaled by a factor drawn from the measured spread around that fit when the file
gives one, and copies at measured GB/s per direction. A `bench.step` record instead keeps the roofline
at the rates that benchmark measured (HBM bandwidth x its decode share of the roofline at the
largest batch, and its prefill share of bf16 peak), and takes its op-by-op batch-1 decode time as
the floor of a step with prompt tokens (such steps run outside the CUDA graphs, host-bound).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from superinfer.engine.core.plan import StepPlan
from superinfer.engine.core.step_time import StepShape, StepTimeModel
from superinfer.sim.hardware import HardwareProfile
from superinfer.sim.model_spec import ModelSpec
from superinfer.workload.device_timeline import StepCost


def block_bytes(model: ModelSpec, block_size: int) -> int:
    return model.kv_bytes_per_token() * block_size


def copy_bandwidths(hw: HardwareProfile, duplex: str) -> tuple[float, float]:
    """(GPU->CPU, CPU->GPU) bytes/s each copy direction gets under the duplex mode."""
    if duplex == "full":
        return hw.link_bw_duplex / 2, hw.link_bw_duplex / 2
    return hw.link_bw_one_way, hw.link_bw_one_way


@dataclass(frozen=True)
class RooflineCost(StepCost):
    model: ModelSpec | None = None
    hw: HardwareProfile | None = None

    def terms(self, tokens: int, context: float, attended: float) -> tuple[float, float]:
        """(memory seconds, compute seconds) of a step computing `tokens` tokens over `context`
        cached tokens in all (KV read), `attended` token pairs in all (attention FLOPs)."""
        m, hw = self.model, self.hw
        assert m is not None and hw is not None
        read = m.weight_bytes_read(tokens) + m.kv_bytes_per_token() * context
        flops = 2.0 * m.active_params * tokens + 4.0 * m.num_layers * m.num_heads * m.head_dim * attended
        return read / (hw.hbm_bw * hw.hbm_efficiency), flops / (hw.peak_flops * hw.flops_efficiency)

    def compute(self, plan: StepPlan) -> float:
        if not plan.num_seqs:
            return 0.0
        context = plan.num_context_tokens
        # causal: the i-th new token sees start_pos + i (a decode row sees start_pos + 1)
        attended = sum(len(s.token_ids) * (s.start_pos + (len(s.token_ids) + 1) / 2) for s in plan.seqs)
        attended += sum(plan.decodes.start_pos) + len(plan.decodes)
        tokens = plan.num_tokens
        memory, flops = self.terms(tokens, context, attended)
        device = self.base_s + max(memory, flops)
        assert self.hw is not None
        graphed = tokens == plan.num_seqs  # one new token a sequence: the decode graphs run it
        return device if graphed else max(device, self.hw.eager_step_s)


def roofline_cost(model: ModelSpec, hw: HardwareProfile, block_size: int, duplex: str) -> RooflineCost:
    out_bw, in_bw = copy_bandwidths(hw, duplex)
    nbytes = block_bytes(model, block_size)
    return RooflineCost(
        base_s=hw.launch_s,
        per_token_s=0.0,
        per_seq_s=0.0,
        per_block_out_s=nbytes / out_bw,
        per_block_in_s=nbytes / in_bw,
        model=model,
        hw=hw,
    )


def spread_quantiles(ratios: Sequence[float], points: int = 101) -> list[float]:
    """Measured over predicted step times, at `points` evenly spaced quantiles (min to max)."""
    if not ratios:
        return []
    r = sorted(ratios)
    return [r[round(i * (len(r) - 1) / (points - 1))] for i in range(points)]


@dataclass(frozen=True)
class PromptStepCost:
    """A step that computes prompt tokens, where it costs apart from a decode step (on a GPU it
    runs op by op, outside the decode graphs): fixed + per token + per thousand context tokens."""

    base_s: float
    per_token_s: float
    per_kcontext_s: float
    # Its own spread (measured over predicted, as CalibratedCost.spread): on an H100 the steps with
    # prompt tokens spread wider (99th percentile 2.7x their fit) than decode steps (1.6x). Empty:
    # they draw from the decode steps' spread.
    spread: tuple[float, ...] = ()


@dataclass(frozen=True)
class CalibratedCost(StepCost):
    per_kcontext_s: float = 0.0  # per thousand tokens attended to (the engine's StepTimeModel form)
    # Measured step time over the fit's prediction, at evenly spaced quantiles: each step draws its
    # ratio from them (seeded), so simulated steps spread like measured ones. Empty: no spread.
    spread: tuple[float, ...] = ()
    prompt: PromptStepCost | None = None  # None: such steps cost as the rest
    rng: random.Random = field(default_factory=lambda: random.Random(0), compare=False, repr=False)

    def compute(self, plan: StepPlan) -> float:
        if not plan.num_seqs:
            return 0.0
        kcontext = plan.num_context_tokens / 1000.0
        p = self.prompt
        spread = self.spread
        if p is not None and plan.num_tokens > plan.num_seqs:
            seconds = p.base_s + p.per_token_s * plan.num_tokens + p.per_kcontext_s * kcontext
            spread = p.spread or spread
        else:
            seconds = super().compute(plan) + self.per_kcontext_s * kcontext
        return seconds * self._ratio(spread) if spread else seconds

    def _ratio(self, q: tuple[float, ...]) -> float:
        """A draw from a spread, interpolated between its quantiles."""
        x = self.rng.random() * (len(q) - 1)
        i = int(x)
        return q[i] + (q[min(i + 1, len(q) - 1)] - q[i]) * (x - i)


def read_json(path: Path) -> dict:
    """A JSON file, gzip-compressed or not."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def _ratios(model: StepTimeModel, steps: Sequence[tuple[StepShape, float]]) -> list[float]:
    return [seconds / p for shape, seconds in steps if (p := model.predict(shape)) > 0]


def _fitted(steps: Sequence[tuple[StepShape, float]]) -> StepTimeModel:
    model = StepTimeModel(decay=1.0)
    for shape, seconds in steps:
        model.observe(shape, seconds)
    return model


def fit_calibration(
    steps: Sequence[tuple[StepShape, float]],
    per_block_out_s: float,
    per_block_in_s: float,
    prompt_steps: Sequence[tuple[StepShape, float]] = (),
) -> dict:
    """load_calibration's JSON from measured steps (shape, seconds): fitted as the engine's
    step-time model does (fixed + per token + per thousand context tokens, none negative), the
    `prompt_steps` apart when given (those computing prompt tokens), each kind with its measured
    spread around its fit, and the copies' measured time per block."""
    model = _fitted(steps)
    base, per_token, per_kcontext = model.coefficients() if steps else (0.0, 0.0, 0.0)
    out: dict = {"base_s": base, "per_token_s": per_token, "per_kcontext_s": per_kcontext}
    if prompt_steps:
        prompt = _fitted(prompt_steps)
        out["prompt_step"] = dict(zip(("base_s", "per_token_s", "per_kcontext_s"), prompt.coefficients(), strict=True))
        out["prompt_step"]["spread"] = spread_quantiles(_ratios(prompt, prompt_steps))
    out |= {
        "step_time_spread": spread_quantiles(_ratios(model, steps)),
        "per_block_out_s": per_block_out_s,
        "per_block_in_s": per_block_in_s,
    }
    return out


def calibration_from_step_log(log: dict) -> dict:
    """fit_calibration of a `bench.slo --step-log` run, the steps with prompt tokens apart (on a
    GPU they run op by op: ~30 ms on an H100 for Llama-3-8B whatever their tokens, where a decode
    step replays a graph): a step's time runs from the collection of the step before it (or its own
    planning, if later) to its own collection, its own submission moved into it where it came
    earlier; the copies' time per block is the same both ways (the log sums them; none in a run
    without copies)."""
    s = log["steps"]
    n = len(s["t"])
    # With async scheduling the host plans and submits a step before it collects the one before
    # (t[i] < done[i-1]): the submission, the launches of an op-by-op step (~25 ms on an H100),
    # falls in the interval that ends with the earlier step's collection, and belongs to the later.
    submit = s.get("submit_s") or [0.0] * n
    early = [0.0, *(submit[i] if s["t"][i] < s["done"][i - 1] else 0.0 for i in range(1, n)), 0.0]
    decodes: list[tuple[StepShape, float]] = []
    prompts: list[tuple[StepShape, float]] = []
    for i in range(1, n):
        seconds = s["done"][i] - max(s["done"][i - 1], s["t"][i]) + early[i] - early[i + 1]
        if s["seqs"][i] and seconds > 0:
            steps = prompts if s["tokens"][i] > s["seqs"][i] else decodes
            steps.append((StepShape(s["tokens"][i], s["context"][i]), seconds))
    blocks = sum(s["blocks_out"]) + sum(s["blocks_in"])
    per_block = sum(x or 0.0 for x in s["copy_seconds"]) / blocks if blocks else 0.0
    return fit_calibration(decodes, per_block, per_block, prompts)


def load_calibration(path: Path, model: ModelSpec, block_size: int) -> CalibratedCost:
    """JSON {"base_s", "per_token_s", "per_seq_s", "per_kcontext_s", optionally "step_time_spread"
    (see CalibratedCost.spread), and per direction either "copy_out_gb_s"/"copy_in_gb_s" or
    "per_block_out_s"/"per_block_in_s", and optionally "prompt_step": {"base_s", "per_token_s",
    "per_kcontext_s", optionally "spread"} for steps that compute prompt tokens}; missing step
    terms are 0. Or a `bench.slo --step-log` file (gzip too), fitted by `calibration_from_step_log`."""
    raw = read_json(path)
    if "steps" in raw:
        raw = calibration_from_step_log(raw)
    raw = raw.get("figures", raw)  # a bench/results record (bench.sim_fidelity) nests it
    raw = raw.get("calibration", raw)
    nbytes = block_bytes(model, block_size)

    def per_block(direction: str) -> float:
        if f"per_block_{direction}_s" in raw:
            return float(raw[f"per_block_{direction}_s"])
        if f"copy_{direction}_gb_s" in raw:
            return nbytes / (float(raw[f"copy_{direction}_gb_s"]) * 1e9)
        raise ValueError(f"calibration {path} gives no copy-{direction} rate (copy_{direction}_gb_s)")

    return CalibratedCost(
        base_s=float(raw.get("base_s", 0.0)),
        per_token_s=float(raw.get("per_token_s", 0.0)),
        per_seq_s=float(raw.get("per_seq_s", 0.0)),
        per_kcontext_s=float(raw.get("per_kcontext_s", 0.0)),
        spread=tuple(float(r) for r in raw.get("step_time_spread", ())),
        prompt=_prompt_step(raw["prompt_step"]) if "prompt_step" in raw else None,
        per_block_out_s=per_block("out"),
        per_block_in_s=per_block("in"),
    )


def _prompt_step(raw: dict) -> PromptStepCost:
    return PromptStepCost(
        float(raw["base_s"]),
        float(raw["per_token_s"]),
        float(raw["per_kcontext_s"]),
        tuple(float(r) for r in raw.get("spread", ())),
    )


def profile_from_step_record(hw: HardwareProfile, record: dict) -> HardwareProfile:
    """The profile with `bench.step`'s measured rates in place of nominal x efficiency."""
    figures = record["figures"]
    shares = sorted(
        (int(k.removeprefix("decode_b").removesuffix("_share_of_roofline")), v)
        for k, v in figures.items()
        if k.startswith("decode_b") and k.endswith("_share_of_roofline")
    )
    if not shares or "hbm_gb_s_measured" not in figures or "prefill_share_of_bf16_peak" not in figures:
        raise ValueError("a bench.step record needs hbm_gb_s_measured, decode_b*_share_of_roofline and prefill_share")
    return dataclasses.replace(
        hw,
        hbm_bw=figures["hbm_gb_s_measured"] * 1e9,
        hbm_efficiency=shares[-1][1],
        flops_efficiency=figures["prefill_share_of_bf16_peak"],
        # op by op a batch-1 decode is all launches: the host time of a step outside the graphs
        eager_step_s=figures.get("decode_b1_ms_eager", 0.0) / 1000.0,
    )
