"""Hardware profiles: the numbers the roofline cost model needs, per device.

Nominal HBM bandwidth and bf16 peak from the vendors' sheets; host-link rates as measured for large
pinned copies (per direction alone, and both directions at once). The efficiencies are the share
of the nominal figure a good engine reaches (decode ~80% of HBM bandwidth, prefill ~55% of peak).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    hbm_bytes: float  # device memory
    hbm_bw: float  # bytes/s, nominal
    peak_flops: float  # bf16 dense, FLOP/s
    link_bw_one_way: float  # host link, bytes/s, one direction alone
    link_bw_duplex: float  # host link, bytes/s, both directions at once (sum)
    host_bytes: float  # CPU memory available to the KV tier
    hbm_efficiency: float = 0.8
    flops_efficiency: float = 0.55
    launch_s: float = 0.0005  # fixed cost of a step: kernel launches, sampling, host sync
    host_s: float = 0.0005  # scheduler host time per step (hidden behind the device with async scheduling)
    # The host time of a step that runs op by op (CUDA graphs cover steps of one new token a
    # sequence, so any step with a prompt chunk): its floor, the launches outlasting the device
    # work. 0: not modelled.
    eager_step_s: float = 0.0


PROFILES: dict[str, HardwareProfile] = {
    "gh200": HardwareProfile(
        "gh200",
        "NVIDIA GH200 (144 GB HBM3, NVLink-C2C to 480 GB Grace LPDDR5X)",
        hbm_bytes=144 * GB,
        hbm_bw=4000 * GB,
        peak_flops=989e12,
        link_bw_one_way=200 * GB,
        link_bw_duplex=384 * GB,
        host_bytes=480 * GB,
    ),
    "h100": HardwareProfile(
        "h100",
        "NVIDIA H100 SXM (80 GB HBM3), host link PCIe Gen5 x16",
        hbm_bytes=80 * GB,
        hbm_bw=3350 * GB,
        peak_flops=989e12,
        link_bw_one_way=50 * GB,
        link_bw_duplex=83 * GB,
        host_bytes=512 * GB,
    ),
    "h200": HardwareProfile(
        "h200",
        "NVIDIA H200 (141 GB HBM3e), host link PCIe Gen5 x16",
        hbm_bytes=141 * GB,
        hbm_bw=4800 * GB,
        peak_flops=989e12,
        link_bw_one_way=50 * GB,
        link_bw_duplex=83 * GB,
        host_bytes=512 * GB,
    ),
    # A small server CPU standing for both tiers (the "device" is DRAM): use a calibration file for
    # anything but rough shapes.
    "cpu": HardwareProfile(
        "cpu",
        "x86 server CPU, a few cores (DRAM for both tiers)",
        hbm_bytes=64 * GB,
        hbm_bw=40 * GB,
        peak_flops=1e12,
        link_bw_one_way=10 * GB,
        link_bw_duplex=12 * GB,
        host_bytes=64 * GB,
        hbm_efficiency=0.5,
        flops_efficiency=0.3,
        launch_s=0.002,
        host_s=0.0005,
    ),
}
ALIASES = {"h100-pcie": "h100", "h200-pcie": "h200", "gh200-c2c": "gh200"}


def get_profile(name: str) -> HardwareProfile:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)}")
    return PROFILES[key]
