"""What one simulated replica is: model, hardware, cost model, KV sizing and scheduler knobs."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from superinfer.engine.core.policies import RotaryParams
from superinfer.sim.hardware import HardwareProfile, get_profile
from superinfer.sim.model_spec import ModelSpec, load_model_spec
from superinfer.sim.step_cost import block_bytes, load_calibration, profile_from_step_record, read_json, roofline_cost
from superinfer.workload.device_timeline import StepCost

GIB = 1 << 30


@dataclass(frozen=True)
class SimConfig:
    model: str = "llama-3-8b"
    hardware: str = "gh200"
    policy: str = "rotary"
    calibration: Path | None = None  # replaces the roofline with measured costs
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    gpu_kv_gib: float | None = None  # the GPU KV pool's size (default: what the memory budget leaves)
    num_gpu_blocks: int | None = None  # overrides gpu_kv_gib
    cpu_kv_gib: float | None = None  # the CPU tier (default: a quarter of host memory; fcfs: none)
    num_cpu_blocks: int | None = None  # overrides cpu_kv_gib
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    transfer_budget_blocks: int = 2400
    write_through: bool = True
    enable_prefix_caching: bool = True
    duplex: str = "full"
    async_scheduling: bool = True
    host_s: float | None = None  # scheduler host time per step (default: the profile's)
    rotary: RotaryParams = field(default_factory=RotaryParams)

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> SimConfig:
        """From `superinfer simulate`'s flags (sim/cli.py)."""
        return cls(
            model=args.model,
            hardware=args.hardware,
            calibration=args.calibration,
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            gpu_kv_gib=args.gpu_kv_gib,
            num_gpu_blocks=args.num_gpu_blocks,
            cpu_kv_gib=args.cpu_kv_gib,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            transfer_budget_blocks=args.transfer_budget_blocks,
            write_through=args.write_through,
            duplex=args.duplex,
            async_scheduling=args.async_scheduling,
            host_s=None if args.host_ms is None else args.host_ms / 1000.0,
            rotary=RotaryParams(
                alpha=args.rotary_alpha,
                beta_f=args.rotary_beta_f,
                beta_b=args.rotary_beta_b,
                slo_admission=args.slo_admission,
            ),
        )

    def model_spec(self) -> ModelSpec:
        return load_model_spec(self.model)

    def profile(self) -> HardwareProfile:
        return get_profile(self.hardware)

    def block_bytes(self) -> int:
        return block_bytes(self.model_spec(), self.block_size)

    def step_cost(self) -> StepCost:
        hw = self.profile()
        if self.calibration is not None:
            record = read_json(self.calibration)
            if record.get("bench") != "step":
                return load_calibration(self.calibration, self.model_spec(), self.block_size)
            hw = profile_from_step_record(hw, record)
        return roofline_cost(self.model_spec(), hw, self.block_size, self.duplex)

    def num_gpu_blocks_sized(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        nbytes = self.block_bytes()
        if self.gpu_kv_gib is not None:
            return max(1, int(self.gpu_kv_gib * GIB) // nbytes)
        m, hw = self.model_spec(), self.profile()
        # As the engine sizes it: the budget less the weights, peak activations and logits.
        activations = self.max_num_batched_tokens * (4 * m.hidden_size + 3 * m.intermediate_size) * 4
        logits = self.max_num_seqs * m.vocab_size * 16
        budget = hw.hbm_bytes * self.gpu_memory_utilization - m.weight_bytes - activations - logits - (256 << 20)
        if budget < nbytes:
            raise ValueError(
                f"{m.name} ({m.weight_bytes / 1e9:.0f} GB of weights) leaves no KV memory on {hw.name} "
                f"({hw.hbm_bytes / 1e9:.0f} GB at utilization {self.gpu_memory_utilization})"
            )
        return int(budget // nbytes)

    def num_cpu_blocks_sized(self) -> int:
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        if self.cpu_kv_gib is not None:
            return int(self.cpu_kv_gib * GIB) // self.block_bytes()
        if self.policy == "fcfs":
            return 0
        return int(self.profile().host_bytes / 4) // self.block_bytes()

    def rotary_params(self) -> RotaryParams:
        """The policy's B_xfer is the scheduler's transfer budget: one knob."""
        return dataclasses.replace(self.rotary, transfer_budget_blocks=self.transfer_budget_blocks)

    def host_seconds(self) -> float:
        return self.profile().host_s if self.host_s is None else self.host_s
