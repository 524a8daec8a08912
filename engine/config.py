"""EngineConfig: model, cache, scheduler, SLO defaults and server settings in one validated model."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from superinfer.engine.contract import (
    DEFAULT_PORT,
    DEFAULT_STALL_FACTOR,
    DEFAULT_TBT_SLO_MS,
    DEFAULT_TTFT_SLO_MS,
    MAX_SLO_MS,
)
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import SLOClass, class_table, parse_classes


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Model
    model: str = Field(
        "tiny",
        description="HF folder, a Hugging Face model (org/name or hf://org/name[@revision], downloaded into the HF "
        "cache unless already there), or a preset name",
    )
    revision: str | None = Field(None, description="branch, tag or commit of a Hugging Face model (as @revision)")
    download_dir: str | None = Field(
        None,
        description="Hugging Face cache folder to download models into and load them from (default: HF_HUB_CACHE, "
        "else HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    offline: bool = Field(
        False,
        description="never contact the Hugging Face Hub: models come from the cache only (also HF_HUB_OFFLINE=1)",
    )
    served_model_name: str | None = Field(None, min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N")
    dummy_weights: bool = Field(False, description="random weights of the model's architecture")
    seed: int = 0
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads of each rank (default: OMP_NUM_THREADS, else all cores but one, at least 1, "
        "shared by the tensor-parallel ranks)",
    )
    engine_process: bool = Field(
        True,
        description="run the engine core (scheduler, model step, sampling; rank 0 with -tp) in a process of its own, "
        "the server's process keeping HTTP, tokenization, detokenization and stop strings (--no-engine-process: "
        "in a thread of the server's process)",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="split the model over this many devices (one process per rank, Megatron style; on CUDA "
        "GPUs --device onwards)",
    )

    # KV cache
    block_size: int = Field(16, ge=1, le=256)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    num_gpu_blocks: int | None = Field(None, ge=1, description="overrides the memory-based sizing")
    cpu_kv_gib: float | None = Field(
        None,
        ge=0,
        description="host memory for the CPU KV tier (default with rotary/watermark: sized from the host's "
        "available memory and the GPU KV pool, logged at startup; with fcfs: 0)",
    )
    num_cpu_blocks: int | None = Field(None, ge=0, description="overrides --cpu-kv-gib")
    kv_cache_gib_cpu_device: float = Field(
        1.0, gt=0, description="KV budget when the model itself runs on the CPU (no device memory to probe)"
    )
    enable_prefix_caching: bool = True
    duplex: Literal["full", "half", "serial"] = Field(
        "full",
        description="how KV copies run: full (both directions at once, beside the model step), half (one "
        "direction at a time, beside the model step), serial (before the model step: the ablation baseline)",
    )
    kv_copy_method: Literal["auto", "runs", "kernel", "batch"] = Field(
        "auto",
        description="how a step's KV copies between the tiers are issued: runs (one copy per run of consecutive "
        "blocks), kernel (one Triton kernel over the pinned CPU tier), batch (one cudaMemcpyBatchAsync; CUDA >= 12.8 "
        "and cuda-bindings), auto (on CUDA each is timed at startup and the fastest kept per direction; runs "
        "on the CPU). A named method is checked at startup and refused where it cannot run",
    )
    write_through: bool = Field(
        True,
        description="copy full KV blocks to the CPU tier as they fill (once half the GPU pool is in use, a request "
        "has been rotated out, or the waiting requests need more blocks than are free), so a rotation copies only "
        "the tail",
    )
    cpu_linear: Literal["onednn", "torch"] = Field(
        "onednn",
        description="float32 linear layers on the CPU: onednn (each weight reordered once into oneDNN's layout; "
        "faster at a decode step's row counts, and held beside the dense weight: twice those weights' memory), "
        "torch (F.linear). Other dtypes and devices always use torch's matmul",
    )
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto",
        description="paged attention: triton (the Triton kernels; needs the gpu extra, and on the CPU "
        "TRITON_INTERPRET=1: interpreted, for tests), cpu (a C kernel for the decodes, built at first use with the "
        "system's C compiler), torch (the reference: gather + SDPA), auto (triton on CUDA when triton imports; on "
        "the CPU cpu when it builds, else torch)",
    )

    enforce_eager: bool = Field(
        False,
        description="run every step op by op; otherwise, on one GPU with the triton attention, decode steps replay "
        "a CUDA graph captured at startup for each padded batch size",
    )
    piecewise_graphs: bool = Field(
        False,
        description="also capture, per padded token count, the forward between attention calls as CUDA graphs, "
        "for steps with prompt tokens (attention runs op by op between them); not yet measured on a GPU",
    )

    # Scheduler
    policy: Literal["fcfs", "rotary", "watermark"] = "fcfs"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    ttft_slo_ms: float = Field(DEFAULT_TTFT_SLO_MS, gt=0, le=MAX_SLO_MS)
    tbt_slo_ms: float = Field(DEFAULT_TBT_SLO_MS, gt=0, le=MAX_SLO_MS)
    stall_slo_ms: float | None = Field(
        None,
        gt=0,
        le=MAX_SLO_MS,
        description="the default class's stall budget: the longest gap between two tokens a stream may have "
        f"and still meet its TBT SLO (at least --tbt-slo-ms; unset: {DEFAULT_STALL_FACTOR:g}x --tbt-slo-ms)",
    )
    slo_classes: str | None = Field(
        None,
        description='named SLO classes as JSON, e.g. \'{"interactive": {"ttft_ms": 500, "tbt_ms": 100, '
        '"priority": 1}}\'; they replace the built-in interactive and batch',
    )
    rotary_alpha: float = Field(3.0, ge=0)
    rotary_beta_f: float = Field(0.5, ge=0)
    rotary_beta_b: float = Field(0.0, ge=0)
    transfer_budget_blocks: int = Field(2400, ge=1)
    rotary_min_residency_ms: float = Field(
        250.0, ge=0, description="rotary: a request brought to the GPU runs at least this long before it can leave"
    )
    slo_admission: bool = Field(
        True,
        description="rotary: from measured step times, cap prefill per step and hold new requests that would push "
        "streaming requests past their TBT SLO",
    )
    async_scheduling: bool | None = Field(
        None, description="plan step t+1 while the device runs step t (default: on with CUDA, off on CPU)"
    )
    max_waiting_requests: int | None = Field(
        None, ge=1, description="queue bound: past it new requests get 503 with Retry-After"
    )

    # Server
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=1, description="(an empty key would turn authentication off)")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="how tool calls are read from this model's output (hermes: Qwen2.5/Qwen3/Hermes; llama3_json: "
        "Llama 3.x); default: the one the model's chat template or family implies",
    )
    metrics_compat: Literal["vllm"] | None = None
    max_request_bytes: int = Field(4 << 20, ge=1024, description="largest request body accepted (else 413)")
    shutdown_timeout_s: float = Field(45.0, ge=0)

    @field_validator("slo_classes", mode="before")
    @classmethod
    def _classes_as_json(cls, value: Any) -> Any:
        if isinstance(value, dict):
            value = json.dumps(value)
        if isinstance(value, str):
            parse_classes(value)  # a clear error at startup, naming the bad class and field
        return value

    @model_validator(mode="after")
    def _stall_at_least_tbt(self) -> EngineConfig:
        if self.stall_slo_ms is not None and self.stall_slo_ms < self.tbt_slo_ms:
            raise ValueError(
                f"stall_slo_ms ({self.stall_slo_ms:g}) must be at least tbt_slo_ms ({self.tbt_slo_ms:g}): "
                "a stall is a gap longer than the TBT target"
            )
        return self

    @property
    def default_slo(self) -> SLO:
        """The SLO of requests in the `default` class."""
        return SLO(self.ttft_slo_ms, self.tbt_slo_ms, self.stall_slo_ms)

    def slo_class_table(self) -> dict[str, SLOClass]:
        """Every SLO class of the server, `default` included."""
        named = parse_classes(self.slo_classes) if self.slo_classes is not None else None
        return class_table(named, self.default_slo)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
