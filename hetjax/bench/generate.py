"""``python -m hetjax.bench generate``: ``hetjax generate``'s tokens/s with every param
on the device (``offload.mode=none``) vs the blocks streamed from NVMe
(``offload.mode=stream``, ``offload.params=nvme``: the inference runtime,
``runtime/inference.py``; each new token is one pass of every block's params through
the prefetch window), at GPT-2 small's shape (124M) and Llama
3.2 1B's (1.24B), random params, fp32, greedy. Each row runs in a child process (its
peak RSS is the child's own). Prefill: the prompts' forward (B x P tokens); decode: the
tokens/s of the new tokens after the first."""

from __future__ import annotations

import multiprocessing
import resource
import tempfile
import time

SHAPES = {"gpt_small": "124M", "llama_1b": "1.24B"}


def _row(config_name: str, mode: str, batch: int, prompt: int, new: int, out) -> None:
    """One measurement, in a child process: puts a dict on ``out``."""
    import jax
    import numpy as np

    from hetjax.config import load_config
    from hetjax.inference import InMemoryBlocks, StreamedBlocks, generate
    from hetjax.runtime.inference import InferenceRuntime
    from models import build_model

    config = load_config(config_name).replace(
        model=dict(compute_dtype="float32"),
        train=dict(batch_size=batch, seq_len=prompt + new),
        checkpoint=dict(every_steps=0, at_end=False),
    )
    prompts = np.random.default_rng(0).integers(0, 256, (batch, prompt)).tolist()
    scratch = tempfile.mkdtemp(prefix="hetjax-bench-generate-")
    t0 = time.perf_counter()
    if mode == "none":
        model = build_model(config.model)
        blocks = InMemoryBlocks(model, jax.jit(model.init)(jax.random.key(0)))
    else:
        config = config.replace(
            offload=dict(mode="stream", params="nvme"), memory=dict(nvme_path=scratch)
        )
        blocks = StreamedBlocks(InferenceRuntime(config))
    setup_s = time.perf_counter() - t0
    generate(blocks, prompts, new)  # compiles (the cache's length is prompt + new)
    first = []
    t0 = time.perf_counter()
    generate(blocks, prompts, new, on_tokens=lambda i, _: first.append(time.perf_counter()))
    total_s = time.perf_counter() - t0
    prefill_s = first[0] - t0  # the prompts' forward and the first token
    decode_s = max(total_s - prefill_s, 1e-9)
    if mode != "none":
        blocks.runtime.close()
    out.put(
        dict(
            config=config_name,
            mode=mode,
            batch=batch,
            prompt=prompt,
            new=new,
            setup_s=setup_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_tokens_per_s=batch * (new - 1) / decode_s,
            tokens_per_s=batch * new / total_s,
            peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        )  # fmt: skip
    )


def bench_generate(quick: bool) -> dict:
    shapes = {"llama_tiny": "1.7M"} if quick else SHAPES
    batch, prompt, new = (2, 8, 4) if quick else (1, 16, 16)
    ctx = multiprocessing.get_context("spawn")
    rows = []
    print(
        f"{'shape':<11}{'placement':<18}{'B':>3}{'setup s':>9}{'prefill s':>11}"
        f"{'decode tok/s':>14}{'all tok/s':>11}{'peak RSS GiB':>14}"
    )
    for name, size in shapes.items():
        for mode in ("none", "stream"):
            out = ctx.Queue()
            child = ctx.Process(target=_row, args=(name, mode, batch, prompt, new, out))
            child.start()
            row = out.get()
            child.join()
            rows.append(row)
            where = "in memory" if mode == "none" else "streamed, NVMe"
            print(
                f"{size:<11}{where:<18}{batch:>3}{row['setup_s']:>9.1f}{row['prefill_s']:>11.3f}"
                f"{row['decode_tokens_per_s']:>14.2f}{row['tokens_per_s']:>11.2f}"
                f"{row['peak_rss_gib']:>14.2f}"
            )
        mem, streamed = rows[-2], rows[-1]
        ratio = streamed["decode_tokens_per_s"] / mem["decode_tokens_per_s"]
        print(f"{size}: streamed decode at {ratio:.2f} x in memory's tokens/s")
    return {"rows": rows}
