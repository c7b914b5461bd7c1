"""Per-node host and GPU findings from the node samplers.

Medians of the recent samples, so a single busy second does not raise a
verdict; temperature uses the maximum because one hot sample already throttles.
"""

from __future__ import annotations

from traceml_daemon.analysis.model import NodeSystem, Verdict
from traceml_daemon.analysis.policy import SystemPolicy
from traceml_daemon.analysis.stats import median

GiB = 2**30


def _present(values: list[float | None] | list[int | None]) -> list[float]:
    return [float(v) for v in values if v is not None]


def node_system_verdicts(node: NodeSystem, policy: SystemPolicy) -> list[Verdict]:
    out: list[Verdict] = []
    scope = {"node_rank": node.node_rank}
    name = f"node {node.node_rank}" + (f" ({node.hostname})" if node.hostname else "")
    low: dict[int, float] = {}
    hot: dict[int, float] = {}
    for gpu, samples in sorted(node.gpu_util_pct.items()):
        vals = _present(samples)
        if len(vals) >= policy.min_samples and (m := median(vals)) is not None and m < policy.low_gpu_util_pct:
            low[gpu] = m
    for gpu, samples in sorted(node.gpu_temp_c.items()):
        vals = _present(samples)
        if len(vals) >= policy.min_samples and max(vals) >= policy.hot_gpu_c:
            hot[gpu] = max(vals)
    if low:
        out.append(
            Verdict(
                "LOW_GPU_UTIL",
                "warn",
                scope,
                f"{name}: GPU utilisation median below {policy.low_gpu_util_pct:.0f}% on GPUs {_gpus(low)}",
                {"gpu_util_pct": {str(g): round(v, 1) for g, v in low.items()}, "threshold": policy.low_gpu_util_pct},
                "The GPUs are idle much of the time: look at the step verdicts (input, copy or wait bound) for why, "
                "or raise the batch size.",
            )
        )
    if hot:
        out.append(
            Verdict(
                "GPU_HOT",
                "warn",
                scope,
                f"{name}: GPU temperature reached {max(hot.values()):.0f} C on GPUs {_gpus(hot)}",
                {"gpu_temp_c": {str(g): round(v, 1) for g, v in hot.items()}, "threshold": policy.hot_gpu_c},
                "Hot GPUs throttle their clocks: check the node's cooling and fans, and nvidia-smi -q -d PERFORMANCE "
                "for thermal slowdown.",
            )
        )
    used = _present(node.mem_used_bytes)
    if node.mem_total_bytes and len(used) >= policy.min_samples:
        frac = (median(used) or 0.0) / node.mem_total_bytes
        if frac >= policy.host_mem_frac:
            out.append(
                Verdict(
                    "HOST_MEM_SATURATED",
                    "critical" if frac >= policy.host_mem_critical_frac else "warn",
                    scope,
                    f"{name}: host RAM {frac:.0%} used ({(median(used) or 0.0) / GiB:.1f} of {node.mem_total_bytes / GiB:.1f} GiB)",
                    {
                        "fraction": round(frac, 4),
                        "mem_used_bytes": int(median(used) or 0),
                        "mem_total_bytes": node.mem_total_bytes,
                    },
                    "Close to swapping or the OOM killer: fewer DataLoader workers or smaller prefetch, "
                    "shared-memory datasets, or check for a leak in the training process (see memory creep).",
                )
            )
    cpu = _present(node.cpu_pct)
    if len(cpu) >= policy.min_samples and (m := median(cpu)) is not None and m >= policy.host_cpu_pct:
        out.append(
            Verdict(
                "HOST_CPU_SATURATED",
                "warn",
                scope,
                f"{name}: host CPU {m:.0f}% busy (median)",
                {"cpu_pct": round(m, 1), "threshold": policy.host_cpu_pct},
                "The CPUs are saturated: too many DataLoader workers for the cores, CPU-heavy augmentation, "
                "or other jobs on the node; set OMP_NUM_THREADS and size num_workers to the cores.",
            )
        )
    return out


def system_verdicts(nodes: list[NodeSystem], policy: SystemPolicy) -> list[Verdict]:
    out: list[Verdict] = []
    for node in sorted(nodes, key=lambda n: n.node_rank):
        out.extend(node_system_verdicts(node, policy))
    return out


def _gpus(values: dict[int, float]) -> str:
    return ", ".join(str(g) for g in sorted(values))
