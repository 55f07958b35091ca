"""The report fields of a streaming runtime's step (``streaming.StreamingRuntime``): what
each tier held, what moved, what the optimizer did, gathered from the runtime's parts."""

from __future__ import annotations


def step_report(runtime, step, work, waited: float) -> dict[str, float | int]:
    """A streamed step's report fields (``runtime``: the ``StreamingRuntime``; ``step``: its
    backward's ``StepGradients``; ``work``: the optimizer loop's): bytes per tier, NVMe I/O,
    optimizer work, collectives, experts."""
    host = runtime.param_store.host_bytes() + runtime.states.host_bytes() + step.peak_bytes
    # boundaries in host RAM at their peak during the step (offload.activations)
    host += runtime.boundaries.peak_host_bytes
    read, written = runtime.io.take()
    metrics = {
        "host_bytes": int(host),
        "nvme_bytes": int(runtime.io.nvme_bytes),
        "optimizer_s": waited,  # optimizer time the step waited for
        # the dispatching thread's time in forward and backward not spent dispatching
        "dispatch_outside_s": step.dispatch_outside_s,
        "dispatch_handoff_wait_s": step.handoff_wait_s,  # of it, the hand-off full
        "grad_copy_wait_s": step.copy_wait_s,  # the gradient thread's waits ...
        "grad_loop_wait_s": step.loop_wait_s,  # ... for copies, for the optimizer
        "optimizer_busy_s": work.busy_s,  # time the loop worked (overlapped or not)
        "optimizer_params": work.params,  # parameters updated (padded slabs, redos too)
        "optimizer_device_params": work.device_params,  # of the device cache
        "nvme_read_bytes": int(read),
        "nvme_write_bytes": int(written),
        "optimizer_redo": work.redo,
        "optimizer_deferred": work.deferred,
        **runtime.parallel.step_metrics(),
        **(runtime.experts.take() if runtime.experts else {}),
        **runtime.deferred.take(),
    }
    if runtime.ledger.accounting:  # (the accounted steps only)
        metrics["device_bytes_peak"] = int(runtime.ledger.peak.get("device", 0))
    if runtime.config.optimizer.mode == "lockfree":
        metrics["optimizer_lag_steps"] = runtime.loop.unapplied
    return metrics
