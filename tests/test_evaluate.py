"""hetjax eval: the loss of a run's newest checkpoint on the held-out split equals the
validation loss the run reported (the same params, batches and runtime), in memory and
streamed from NVMe, on a token file's windows and on jsonl records with their masks."""

import json
import math

import pytest
from equivalence import assert_losses_close

from hetjax import cli
from hetjax.evaluate import evaluate_checkpoint
from hetjax.train import train


def _with_checkpoint(tiny, **sections):
    return tiny(checkpoint=dict(every_steps=0, at_end=True), **sections)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny GPT run of 1 step in memory with a checkpoint at its end: (config,
    workdir, the run's result), shared by this module's default-run tests."""
    from conftest import tiny_config

    config = _with_checkpoint(tiny_config, train=dict(steps=1, eval_batches=1))
    workdir = tmp_path_factory.mktemp("tiny_run")
    return config, workdir, train(config, workdir, verbose=False)


def test_eval_equals_the_runs_validation_loss(tiny_run):
    """A tiny GPT run (1 step, in memory) and the evaluation of its checkpoint: the same
    loss within 1e-5 (fp32; the run evaluates its published params, eval the restored
    masters)."""
    config, workdir, run = tiny_run
    assert math.isfinite(run.val_loss)
    assert_losses_close([evaluate_checkpoint(config, workdir).loss], [run.val_loss])


# ~25 s on 2 busy cores: a run, then the command
@pytest.mark.slow
def test_eval_command_prints_the_loss_and_perplexity(tiny, tmp_path, capsys):
    """``hetjax eval --config FILE --workdir W`` of a run's checkpoint: the loss it
    prints equals the run's validation loss (1e-5), the perplexity exp of it."""
    config = _with_checkpoint(tiny, train=dict(steps=2))
    run = train(config, tmp_path, verbose=False)
    config_file = tmp_path / "tiny_eval.py"  # the same config, as a file for the command
    config_file.write_text(
        "from conftest import tiny_config\n\n\ndef get_config():\n"
        "    return tiny_config(checkpoint=dict(every_steps=0, at_end=True), "
        "train=dict(steps=2))\n"
    )
    assert cli.main(["eval", "--config", str(config_file), "--workdir", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert_losses_close([printed["loss"]], [run.val_loss])
    assert abs(printed["perplexity"] - math.exp(printed["loss"])) < 1e-9 * printed["perplexity"]


# ~40 s on 2 busy cores: a streamed run with its state on NVMe, then its evaluation
@pytest.mark.slow
def test_eval_of_a_jsonl_run_streamed_from_nvme(tiny, tmp_path):
    """jsonl records (the loss on completions only), offload.mode=stream with the
    optimizer state on NVMe: eval of the checkpoint in the same placement and in memory
    equals the run's validation loss (1e-5)."""
    from test_instruct import _dataset

    path = _dataset(tmp_path)
    common = dict(
        data=dict(format="jsonl", path=path, shuffle=False, val_fraction=0.2),
        train=dict(steps=3, batch_size=4, seq_len=32, eval_batches=1),
        model=dict(max_seq_len=32),
    )
    streamed = dict(mode="stream", params="nvme", optimizer="nvme")
    config = _with_checkpoint(tiny, offload=streamed, **common)
    run = train(config, tmp_path / "run", verbose=False)
    for placement in (streamed, dict(mode="none")):
        result = evaluate_checkpoint(config.replace(offload=placement), tmp_path / "run")
        assert_losses_close([result.loss], [run.val_loss])


# ~11 s: a transformers model built, saved, imported
@pytest.mark.slow
def test_eval_of_an_hf_directory_equals_transformers_loss(tiny, tmp_path):
    """``hetjax eval --hf`` (no workdir: the checkpoint's params): the loss of a tiny
    random Llama made with transformers on the held-out windows equals transformers'
    own loss of the same windows (its labels shifted inside the model), 1e-5."""
    import dataclasses

    import numpy as np
    import torch
    from hf_models import build_hf_model

    from hetjax.data import make_datasets
    from hetjax.hf import model_config_from_hf

    hf = build_hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    model = model_config_from_hf(tmp_path / "hf", tiny().model)
    config = tiny(model=dataclasses.asdict(model), train=dict(eval_batches=1))
    result = evaluate_checkpoint(config)
    windows = make_datasets(config)[1].batch(0)  # (B, T + 1)
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(windows)).long()
        expected = float(hf(input_ids=ids, labels=ids).loss)
    assert_losses_close([result.loss], [expected])


# ~40 s on 2 busy cores: two streamed runs and an evaluation
@pytest.mark.slow
def test_jsonl_in_batch_chunks_equals_unchunked_and_evaluates(tiny, tmp_path):
    """offload.batch_chunks=2 on jsonl records (each chunk's completion tokens weigh
    its loss, runtime/stages/chunks.py): the steps' losses and the validation loss equal the
    unchunked run's (fp32, SGD, 1e-5), and ``hetjax eval`` of the chunked run's
    checkpoint, chunked too, equals its validation loss."""
    from test_instruct import _dataset

    path = _dataset(tmp_path)
    config = _with_checkpoint(
        tiny,
        data=dict(format="jsonl", path=path, shuffle=False, val_fraction=0.2),
        train=dict(steps=3, batch_size=4, seq_len=32, eval_batches=1),
        model=dict(max_seq_len=32),
        optimizer=dict(name="sgd", lr=0.1),
    )
    runs = {}
    for n in (1, 2):
        chunked = config.replace(offload=dict(mode="stream", batch_chunks=n))
        runs[n] = train(chunked, tmp_path / f"run{n}", verbose=False)
    assert_losses_close(runs[2].losses, runs[1].losses)
    assert_losses_close([runs[2].val_loss], [runs[1].val_loss])
    result = evaluate_checkpoint(chunked, tmp_path / "run2")
    assert_losses_close([result.loss], [runs[2].val_loss])


def _t5_jsonl(tiny, tmp_path):
    """A tiny random T5 made with transformers and a jsonl file whose prompts (3 to 16
    bytes) and completions (1 to 10, with no EOS: bytes) differ in length: (transformers'
    model, the config importing it, reading the file; rows of 24: two or three records
    a row)."""
    import dataclasses

    import numpy as np
    from test_instruct import _write
    from test_t5 import _hf_t5, t5_config

    from hetjax.hf import model_config_from_hf

    rng = np.random.default_rng(0)
    letters = lambda lo, hi: "".join(rng.choice(list("abcdefgh"), rng.integers(lo, hi)))
    records = [{"prompt": letters(3, 17), "completion": letters(1, 11)} for _ in range(20)]
    path = _write(tmp_path / "t5.jsonl", records)
    config = t5_config(tiny)
    hf = _hf_t5(config, tmp_path / "t5")
    model = model_config_from_hf(tmp_path / "t5", config.model)
    return hf, config.replace(
        model=dataclasses.asdict(model),
        data=dict(format="jsonl", path=path, shuffle=False, val_fraction=0.4),
        train=dict(batch_size=2, seq_len=24, eval_batches=1),
    )


def _records_of(rows):
    """Packed T5 rows (B, 4, T) -> each record's (prompt ids, completion ids), in order
    (a side's padding, whose targets are all ignored, left out)."""
    import numpy as np

    from models.staged import segment_ids

    out = []
    for ids, enc, dec, targets in rows:
        enc_seg, dec_seg = (np.asarray(segment_ids(p[None]))[0] for p in (enc, dec))
        for k in range(1, int(dec_seg.max()) + 1):
            completion = targets[dec_seg == k]
            if (completion >= 0).all():
                out.append((ids[enc_seg == k].tolist(), completion.tolist()))
    return out


# ~10-20 s on 2 busy cores: a transformers T5 built and saved, our loss compiled; the
# default run's check of T5 rows is tests/test_packing.py's by hand
@pytest.mark.slow
def test_t5_jsonl_loss_equals_transformers_records_one_per_row(tiny, tmp_path):
    """T5 on jsonl, records packed on both sides (the prompts the encoder's, the
    completions the decoder's targets; each attends only to itself): ``hetjax eval
    --hf`` of the held-out rows equals transformers' loss of the same records one per
    row (the prompt's attention_mask, labels -100 past the completion), 1e-5 fp32."""
    import torch

    from hetjax.instruct import make_datasets

    hf, config = _t5_jsonl(tiny, tmp_path)
    result = evaluate_checkpoint(config)
    _, val, described = make_datasets(config)
    assert "packed on both sides" in described  # the log says so
    records = _records_of(val.batch(0).reshape(2, 4, 24))
    assert len(records) > 2  # packed: more records than rows
    P, N = (max(len(r[k]) for r in records) for k in (0, 1))
    ids = torch.zeros((len(records), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full((len(records), N), -100, dtype=torch.long)
    for r, (prompt, completion) in enumerate(records):
        ids[r, : len(prompt)], mask[r, : len(prompt)] = torch.tensor(prompt), 1
        labels[r, : len(completion)] = torch.tensor(completion)
    with torch.no_grad():
        expected = float(hf(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert_losses_close([result.loss], [expected])


# ~40 s on 2 busy cores: two runs and an evaluation
@pytest.mark.slow
def test_t5_jsonl_trains_streamed_as_in_memory(tiny, tmp_path):
    """T5 on jsonl, imported from transformers: a streamed run (params on NVMe) takes the
    same steps as in memory (losses and validation loss 1e-5, SGD), and ``hetjax eval``
    of its checkpoint equals its validation loss."""
    _, config = _t5_jsonl(tiny, tmp_path)
    config = _with_checkpoint(
        lambda **kw: config.replace(**kw), train=dict(steps=3), optimizer=dict(name="sgd", lr=0.1)
    )
    runs = {}
    for mode in ("none", "stream"):
        placed = config.replace(
            offload=dict(mode=mode, params="nvme" if mode == "stream" else "host")
        )
        runs[mode] = train(placed, tmp_path / mode, verbose=False)
    assert_losses_close(runs["stream"].losses, runs["none"].losses)
    assert_losses_close([runs["stream"].val_loss], [runs["none"].val_loss])
    assert runs["stream"].losses[-1] < runs["stream"].losses[0]
    result = evaluate_checkpoint(placed, tmp_path / "stream")
    assert_losses_close([result.loss], [runs["stream"].val_loss])


def test_eval_batches_0_evaluates_every_row_once(tiny_run):
    """``--batches 0`` over a held-out split of 15 windows with batch 4: 15 rows, each
    once (the last partial batch of 3 included), the loss the mean of the 15 windows'
    own losses (the model's loss of each alone, from the checkpoint's params); and of a
    split of 3 windows, fewer than a batch, each of the 3 once (not the first twice)."""
    import jax
    import numpy as np

    from hetjax.checkpoint import restore_newest
    from hetjax.data import make_datasets, split_window
    from models import build_model

    config, workdir, _ = tiny_run
    state, _ = restore_newest(config, workdir)
    loss, params = jax.jit(build_model(config.model).loss), state.params()
    T = config.train.seq_len
    # the corpus' last 250 and 50 tokens: 15 and 3 windows of 17 every 16
    for val_fraction, windows in ((250 / 200_000, 15), (50 / 200_000, 3)):
        config = config.replace(data=dict(val_fraction=val_fraction))
        val = make_datasets(config)[1].tokens
        result = evaluate_checkpoint(config, workdir, batches=0)
        assert result.rows == windows
        rows = [val[k * T : k * T + T + 1][None].astype(np.int32) for k in range(windows)]
        own = [float(loss(params, *split_window("lm", r, T))) for r in rows]
        assert_losses_close([result.loss], [np.mean(own)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--batches", "-2"], "--batches must be 0 (every row once) or more, got -2"),
        (["eval", "--step", "-1"], "--step must be a checkpoint's step"),
    ],
)
def test_eval_refuses_bad_arguments_before_loading(tmp_path, capsys, argv, message):
    """A negative count is one line and exit status 2, before any config or checkpoint
    is read (the workdir named does not exist)."""
    assert cli.main([*argv, "--workdir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_eval_without_config_reads_the_workdirs(tiny_run, capsys):
    """``hetjax eval --workdir W`` without --config evaluates with the config the run
    wrote (W/config.json; the default config's model would not even restore): the run's
    validation loss, and the first line says where the config came from."""
    config, workdir, run = tiny_run
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"config: {workdir / 'config.json'} (the run's)" in out[0]
    assert_losses_close([json.loads(out[-1])["loss"]], [run.val_loss])


# a tiny Llama's config.json as transformers writes it (the keys hetjax reads)
LLAMA_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu",
}  # fmt: skip


def test_command_config_sources(tmp_path):
    """eval's and generate's config: --config when given; else the workdir's
    config.json (overrides applied); else with --hf the library's defaults (auto, the
    budgets measured, no trace), not the tiny demo's 104 MiB / 80 MiB and step-60 trace;
    train's --hf without --config alike."""
    from conftest import tiny_config

    from hetjax import launch
    from hetjax.cli_config import command_config
    from hetjax.config import Config

    saved = tiny_config(train=dict(seq_len=24))
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    _, config, where = command_config(["--workdir", str(tmp_path), "--config.train.steps=3"])
    assert config == saved.replace(train=dict(steps=3)) and "(the run's)" in where
    _, config, _ = command_config(["--workdir", str(tmp_path), "--config", "gpt_tiny"])
    assert config.train.seq_len == 128 and config.memory.device_budget == 104 * 2**20
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(LLAMA_CONFIG_JSON))
    for argv in (
        ["--hf", str(tmp_path / "hf")],
        ["--workdir", str(tmp_path / "x"), "--hf", str(tmp_path / "hf")],
    ):
        _, config, _ = command_config(argv)
        defaults = Config()
        assert (config.memory, config.offload, config.train) == (
            defaults.memory,
            defaults.offload,
            defaults.train,
        )
        assert config.offload.mode == "auto" and config.memory.device_budget == 0
    trained = launch.run_config(*launch.parse_args(["--hf", str(tmp_path / "hf")]))
    assert trained.memory == Config().memory and trained.train.trace_every == 0
    demo = launch.run_config(
        *launch.parse_args(["--config", "gpt_tiny", "--hf", str(tmp_path / "hf")])
    )
    assert demo.memory.host_budget == 80 * 2**20
