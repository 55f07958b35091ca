"""The embedded default: a ~3M-parameter byte-level GPT on the bundled corpus (the
running Python's standard library), trained under a device budget below what in-memory training
needs and a host budget below its optimizer state, so ``offload.mode=auto`` streams the
blocks through the device and keeps the fp32 master + Adam state on NVMe (under the workdir).
Prints the plan, records step 60's timeline (``trace/step_60.png``), times 3 in-memory
steps after the run and ends with the run summary."""

from hetjax.config import Config

NOMINAL_PARAMS = 3.3e6


def get_config() -> Config:
    # the model defaults are this run: 4 layers, d 256, 4 heads, vocab 256
    return Config().replace(
        memory=dict(device_budget="104MiB", host_budget="80MiB"),
        train=dict(steps=60, log_every=10, trace_every=60, in_memory_steps=3),
    )
