"""One process of a multi-process ZeRO-3 run of the tiny test model (tests/test_zero.py).

    python tests/zero_driver.py WORKDIR [KEY=VALUE ...]

The process group comes from HETJAX_COORDINATOR / HETJAX_NUM_PROCESSES /
HETJAX_PROCESS_ID, as under ``python -m hetjax.launch``; overrides are config keys.
Each process trains in ``WORKDIR/proc<index>`` with metrics on (``verbose``: only
process 0 writes ``metrics.jsonl``); process 0 writes the losses, validation loss and
final params to ``WORKDIR/result.npz``."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import tiny_config  # noqa: E402

from hetjax.distributed import initialize  # noqa: E402


def main() -> None:
    workdir = Path(sys.argv[1])
    overrides = dict(arg.split("=", 1) for arg in sys.argv[2:])
    config = tiny_config(offload=dict(mode="stream"), distributed=dict(data_parallel=0))
    config = config.override(overrides)
    initialize(config)
    import jax

    from hetjax.train import train

    result = train(config, workdir / f"proc{jax.process_index()}", verbose=True)
    if jax.process_index() == 0:
        flat = {
            jax.tree_util.keystr(p): a
            for p, a in jax.tree_util.tree_leaves_with_path(result.params)
        }
        np.savez(
            workdir / "result.npz",
            losses=np.asarray(result.losses),
            val_loss=np.asarray(result.val_loss),
            **flat,
        )


if __name__ == "__main__":
    main()
