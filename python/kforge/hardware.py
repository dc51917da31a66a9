"""What the proposers and the roofline need to know about a GPU."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    arch: str  # "sm_90"
    sm_count: int
    l2_bytes: int
    smem_per_block: int  # opt-in maximum of dynamic shared memory per block
    mem_bytes: int
    bandwidth: float  # bytes/s, measured copy bandwidth where known

    @property
    def cc(self) -> int:
        """The compute capability as a number: 90 for sm_90 (and sm_90a)."""
        return int(self.arch.removeprefix("sm_").rstrip("a"))

    @property
    def max_threads_per_sm(self) -> int:
        """Resident threads an SM holds: 2048 on sm_80/sm_90/sm_100, 1536 on the consumer
        and workstation parts (sm_86, sm_87, sm_89, sm_12x), 1024 on sm_75."""
        cc = self.cc
        if cc in (86, 87, 89) or cc >= 120:
            return 1536
        return 1024 if cc == 75 else 2048

    def floor_us(self, nbytes: int) -> float:
        """Time to move nbytes at the copy bandwidth: no kernel that must move them beats it."""
        return nbytes / self.bandwidth * 1e6

    def to_json(self) -> dict:
        return asdict(self)


# Measured on the H200 lent to this project: a device-to-device copy moved 4.27 TB/s.
H200 = Hardware("NVIDIA H200", "sm_90", 132, 60 * 2**20, 227 * 1024, 141 * 10**9, 4.27e12)

# Datasheet-derived bandwidths, scaled by the ~0.89 copy efficiency measured on the H200.
_KNOWN_BW = {"H200": 4.27e12, "H100": 2.98e12, "A100": 1.8e12, "L40": 0.77e12, "L4": 0.27e12, "GB10": 0.24e12}


def current(ordinal: int | None = None) -> Hardware:
    """The GPU kforge would run on; the H200 profile when there is none (CPU-only runs)."""
    from . import cuda

    if not cuda.available():
        return H200
    import torch

    ordinal = torch.cuda.current_device() if ordinal is None else ordinal
    a = cuda.device_attributes(ordinal)
    bw = next((v for k, v in _KNOWN_BW.items() if k in a["name"]), 1.0e12)  # unknown GPU: a cautious guess
    return Hardware(a["name"], f"sm_{a['cc']}", a["sm_count"], a["l2_bytes"], a["smem_per_block_optin"],
                    a["mem_bytes"], bw)
