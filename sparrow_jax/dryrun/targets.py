"""Accelerator targets of `sparrow dryrun`: compile-only device sets for TPU slices and GPU nodes.

A target names a real deployment (``v5p-32``: 16 v5p chips on 4 hosts; ``h100x8``: one node of
8 H100s) and knows how to build its devices without the hardware, through
`jax.experimental.topologies.get_topology_desc`: libtpu for TPUs, the jax CUDA plugin with a GPU
target-config proto for NVIDIA GPUs. Those devices can only compile, which is all a dry run needs.

Each device carries its host (`device.process_index`), so the dry run checks host placement the
way a multi-host launch would. TPU host shapes follow Google's machine types: v5p hosts hold 4
chips (2x2x1); a v5e-8 / v6e-8 is a single host of 8 chips (2x4), larger v5e / v6e slices use
hosts of 4 chips (2x2). GPU nodes hold 8 GPUs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re

import jax

log = logging.getLogger(__name__)

GiB = 1 << 30
INSTALL_HINT = ("bash .ci/compile_env.sh  (installs libtpu and the jax CUDA plugin into "
                ".compile-env/, kept apart from .venv)")


@dataclasses.dataclass(frozen=True)
class Target:
    """One deployment. `hbm_bytes` is the memory of one device (chip or GPU)."""
    name: str
    platform: str                      # "tpu" | "cuda"
    topology: str                      # get_topology_desc topology string
    num_devices: int
    devices_per_host: int
    hbm_bytes: int
    hardware: str                      # sparrow_jax.sparsity.cost_model hardware name
    chips_per_host_bounds: tuple[int, int, int] | None = None   # TPU host shape
    gpu: str = ""                      # "h100" | "h200": which target-config proto

    @property
    def num_hosts(self) -> int:
        return self.num_devices // self.devices_per_host

    @property
    def kernel_platform(self) -> str:
        """The platform name `pallas_kernels.dispatch` uses for this target."""
        return "tpu" if self.platform == "tpu" else "gpu"

    def describe(self) -> str:
        return (f"{self.name}: {self.num_devices} x {self.device_kind} on {self.num_hosts} "
                f"host(s) of {self.devices_per_host}, {self.hbm_bytes / GiB:.1f} GiB HBM each")

    @property
    def device_kind(self) -> str:
        return {"tpu": self.name.split("-")[0].upper()}.get(self.platform, self.gpu.upper())


def _tpu(name: str, topology: str, chips: int, per_host: int, hbm_gib: float, hw: str,
         host_bounds: tuple[int, int, int]) -> Target:
    return Target(name, "tpu", topology, chips, per_host, int(hbm_gib * GiB), hw, host_bounds)


def _gpu(gpu: str, n: int, hbm_bytes: int) -> Target:
    per_host = min(n, 8)
    return Target(f"{gpu}x{n}", "cuda", f"{n // per_host}x1x{per_host}", n, per_host, hbm_bytes,
                  gpu, None, gpu)


# HBM per device as sold: v5e 16 GiB, v5p 95 GiB, v6e 32 GiB, H100 80 GB, H200 141 GB.
# v5p-N counts TensorCores (2 per chip, one megacore device per chip): v5p-32 = 16 chips.
TARGETS: dict[str, Target] = {t.name: t for t in [
    _tpu("v5e-4", "v5e:2x2", 4, 4, 16, "tpu-v5e", (2, 2, 1)),
    _tpu("v5e-8", "v5e:2x4", 8, 8, 16, "tpu-v5e", (2, 4, 1)),
    _tpu("v5e-16", "v5e:4x4", 16, 4, 16, "tpu-v5e", (2, 2, 1)),
    _tpu("v5e-32", "v5e:4x8", 32, 4, 16, "tpu-v5e", (2, 2, 1)),
    _tpu("v5p-8", "v5p:2x2x1", 4, 4, 95, "tpu-v5p", (2, 2, 1)),
    _tpu("v5p-16", "v5p:2x2x2", 8, 4, 95, "tpu-v5p", (2, 2, 1)),
    _tpu("v5p-32", "v5p:2x2x4", 16, 4, 95, "tpu-v5p", (2, 2, 1)),
    _tpu("v5p-64", "v5p:2x4x4", 32, 4, 95, "tpu-v5p", (2, 2, 1)),
    _tpu("v6e-4", "v6e:2x2", 4, 4, 32, "tpu-v6e", (2, 2, 1)),
    _tpu("v6e-8", "v6e:2x4", 8, 8, 32, "tpu-v6e", (2, 4, 1)),
    _tpu("v6e-16", "v6e:4x4", 16, 4, 32, "tpu-v6e", (2, 2, 1)),
    *[_gpu("h100", n, 80 * 10**9) for n in (1, 2, 4, 8, 16, 32)],
    *[_gpu("h200", n, 141 * 10**9) for n in (1, 2, 4, 8, 16, 32)],
]}


def get_target(name: str) -> Target:
    key = name.strip().lower()
    if key not in TARGETS:
        raise ValueError(f"unknown dryrun target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[key]


def _gpu_target_config(gpu: str) -> str:
    """GpuTargetConfigProto text for an H100 SXM (from pallas_kernels.compile_check) or an H200
    (same Hopper die and SM count; 141 GB of HBM3e at 4.8 TB/s)."""
    from pallas_kernels.compile_check import H100_TARGET_CONFIG
    if gpu == "h100":
        return H100_TARGET_CONFIG
    text = re.sub(r"device_memory_size: \d+", "device_memory_size: 150754820096",
                  H100_TARGET_CONFIG)
    text = re.sub(r"memory_bandwidth: \d+", "memory_bandwidth: 4800000000000", text)
    return text.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def toolchain_problem(target: Target) -> str | None:
    """Why `target` cannot be compiled here (the missing package and how to install it), or None.

    Checked before any compile so that a missing toolchain is an error, never a CPU compile."""
    if target.platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            return f"target {target.name} needs libtpu (compile-only TPU toolchain); run: {INSTALL_HINT}"
        return None
    if not any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        return (f"target {target.name} needs the jax CUDA plugin (jax-cuda13-plugin + "
                f"jax-cuda13-pjrt, matching jax {jax.__version__}); run: {INSTALL_HINT}")
    return None


def toolchain_name(target: Target) -> str:
    """A short description of the compiler used, for the log and the report."""
    from importlib.metadata import PackageNotFoundError, version
    pkg = "libtpu" if target.platform == "tpu" else "jax-cuda13-plugin"
    try:
        return f"{pkg} {version(pkg)} (jax {jax.__version__})"
    except PackageNotFoundError:
        return f"{pkg} (jax {jax.__version__})"


def target_devices(target: Target) -> list:
    """The target's compile-only devices, ordered host-major (as `jax.devices()` orders them)."""
    problem = toolchain_problem(target)
    if problem:
        raise RuntimeError(problem)
    from jax.experimental import topologies
    if target.platform == "tpu":
        topo = topologies.get_topology_desc(
            target.topology, platform="tpu",
            chips_per_host_bounds=list(target.chips_per_host_bounds))
    else:
        topo = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                            target_config=_gpu_target_config(target.gpu))
    devices = sorted(topo.devices, key=lambda d: (d.process_index, d.id))
    if len(devices) != target.num_devices:
        raise RuntimeError(f"topology {target.topology} gave {len(devices)} devices, "
                           f"expected {target.num_devices}")
    hosts = {d.process_index for d in devices}
    if len(hosts) != target.num_hosts:
        raise RuntimeError(f"topology {target.topology} gave {len(hosts)} hosts, expected "
                           f"{target.num_hosts}")
    return devices
