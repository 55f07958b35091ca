"""data.format=jsonl: records read and tokenised (bytes here), packed into rows with
positions and completion-only targets written out by hand; bad records refused naming
their line; a jsonl run trains in memory and streamed alike."""

import json

import numpy as np
import pytest
from equivalence import assert_evaluation_equal, assert_losses_close

from hetjax.config import ConfigError
from hetjax.data import split_window
from hetjax.instruct import IGNORED, Tokens, pack, read_records
from hetjax.train import train

X = IGNORED


def _write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_records_packed_by_hand(tmp_path):
    """Bytes: "ab" -> "c" is ids 97 98 99 (prompt 2); text "xyz" is 120 121 122 (every
    token after the first a target); "pq" -> "rstu" (6 ids) does not fit the first row's
    2 free positions of 8 and starts the second; a 10-id record is cut to 8, counted."""
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "ab", "completion": "c"},
            {"text": "xyz"},
            {"prompt": "pq", "completion": "rstu"},
            {"prompt": "0123456", "completion": "789"},
        ],
    )
    packed = pack(read_records(path, Tokens(""), 256), seq_len=8)
    assert packed.cut == 1 and packed.records == 4
    ids, pos, tgt = (packed.rows[:, i] for i in range(3))
    np.testing.assert_array_equal(ids[0], [97, 98, 99, 120, 121, 122, 0, 0])
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 0, 1, 2, 0, 1])
    np.testing.assert_array_equal(tgt[0], [X, 99, X, 121, 122, X, X, X])
    np.testing.assert_array_equal(ids[1], [112, 113, 114, 115, 116, 117, 0, 0])
    np.testing.assert_array_equal(pos[1], [0, 1, 2, 3, 4, 5, 0, 1])
    np.testing.assert_array_equal(tgt[1], [X, 114, 115, 116, 117, X, X, X])
    np.testing.assert_array_equal(ids[2], [48, 49, 50, 51, 52, 53, 54, 55])
    np.testing.assert_array_equal(tgt[2], [X] * 6 + [55, X])  # "7" after the prompt
    # a batch row is ids | positions | targets; split_window makes tokens (B, 2, T)
    tokens, targets = split_window("lm", packed.rows.reshape(3, 24), 8)
    np.testing.assert_array_equal(tokens[:, 0], ids)
    np.testing.assert_array_equal(tokens[:, 1], pos)
    np.testing.assert_array_equal(targets, tgt)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "a"}, "line 2: a record needs 'prompt' and 'completion'"),
        ({"prompt": "a", "completion": ""}, "line 2: the completion is empty"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "line 2: a 'messages' record needs the tokenizer's chat template",
        ),  # fmt: skip
        ("{not json", "line 2: not a JSON record"),
        (
            {"prompt": "a", "completion": "\u00ff"},
            "line 2: token id 195 .* outside the model's vocabulary .model.vocab_size 128.",
        ),  # fmt: skip
    ],
)
def test_bad_record_names_its_line(tmp_path, record, message):
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(ConfigError, match=message):
        read_records(path, Tokens(""), 128)


def _jsonl_config(tiny, path, **offload):
    return tiny(
        data=dict(format="jsonl", path=path, shuffle=False, val_fraction=0.2),
        train=dict(steps=4, batch_size=4, seq_len=32, eval_batches=1),
        model=dict(max_seq_len=32),
        offload=offload or dict(mode="none"),
    )


def _dataset(tmp_path) -> str:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    records = [
        {"prompt": " ".join(rng.choice(words, 2)) + "?", "completion": " " + str(rng.choice(words))}
        for _ in range(60)
    ]
    return _write(tmp_path / "train.jsonl", records)


# ~30 s each on 2 busy cores: two tiny runs
@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [
        dict(mode="stream"),
        # a kept block and a swapped one (their vjps hold the context: the positions),
        # boundaries on the host
        dict(mode="stream", keep_blocks=1, swap_blocks=1, activations="host"),
        dict(mode="stream", params="nvme", optimizer="nvme"),
    ],
    ids=["stream", "keep_swap_host", "nvme"],
)
def test_jsonl_trains_streamed_as_in_memory(tiny, tmp_path, offload):
    """The same jsonl run in memory and streamed: per-step losses, validation loss
    within 1e-5; the loss falls."""
    path = _dataset(tmp_path)
    ref = train(_jsonl_config(tiny, path), tmp_path / "none", verbose=False)
    streamed = train(_jsonl_config(tiny, path, **offload), tmp_path / "s", verbose=False)
    assert_losses_close(streamed.losses, ref.losses)
    assert_evaluation_equal(streamed, ref)
    assert ref.losses[-1] < ref.losses[0]


# ~60 s on 2 busy cores
@pytest.mark.slow
def test_jsonl_first_loss_data_parallel_is_the_mean_of_each_devices(tiny, tmp_path):
    """ZeRO-3 over 2 devices, each its half of the micro-batch's rows: the first step's
    loss is the mean of each half's mean over its completion tokens (what the step
    reports with a mean over devices), and on one device the whole batch's mean; both
    from the initial params and the model's loss (not the runtime), 1e-5."""
    import jax

    from hetjax.instruct import make_datasets
    from models import build_model

    path = _dataset(tmp_path)
    config = _jsonl_config(tiny, path, mode="stream")
    one = train(config, tmp_path / "one", verbose=False)
    two = train(config.replace(distributed=dict(data_parallel=2)), tmp_path / "two", verbose=False)
    model = build_model(config.model)
    params = model.init(jax.random.key(config.train.seed))
    rows = make_datasets(config)[0].batch(0)  # (B, 3 T)
    loss = lambda r: float(model.loss(params, *split_window("lm", r, config.train.seq_len)))
    half = len(rows) // 2
    whole, halves = loss(rows), (loss(rows[:half]) + loss(rows[half:])) / 2
    assert abs(whole - halves) > 1e-4 * whole  # the halves' counts differ: the two differ
    assert_losses_close([one.losses[0]], [whole])
    assert_losses_close([two.losses[0]], [halves])
