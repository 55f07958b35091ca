import numpy as np
import pytest

from hetjax.config import ConfigError
from hetjax.data import TokenWindows, embedded_corpus, load_tokens, make_datasets


def test_documented_order_without_shuffle():
    tokens = np.arange(1000, dtype=np.uint16)
    data = TokenWindows(tokens=tokens, seq_len=10, batch_size=4)
    for i in (0, 3, 7):
        batch = data.batch(i)
        assert batch.shape == (4, 11) and batch.dtype == np.int32
        for r in range(4):
            start = ((i * 4 + r) % data.num_windows) * 10
            np.testing.assert_array_equal(batch[r], np.arange(start, start + 11))
    # inputs are the first T, targets the same shifted by one
    b = data.batch(0)
    np.testing.assert_array_equal(b[:, 1:][:, :-1], b[:, :-1][:, 1:])


def test_order_wraps_around():
    data = TokenWindows(tokens=np.arange(101, dtype=np.uint16), seq_len=10, batch_size=4)
    assert data.num_windows == 10
    np.testing.assert_array_equal(data.batch(2)[2], np.arange(0, 11))  # window 10 -> 0


def test_shuffle_is_reproducible_and_a_permutation():
    tokens = np.arange(401, dtype=np.uint16)
    a = TokenWindows(tokens=tokens, seq_len=10, batch_size=4, shuffle=True, seed=3)
    b = TokenWindows(tokens=tokens, seq_len=10, batch_size=4, shuffle=True, seed=3)
    c = TokenWindows(tokens=tokens, seq_len=10, batch_size=4, shuffle=True, seed=4)
    first_pass = np.concatenate([a.batch(i)[:, 0] for i in range(10)])
    np.testing.assert_array_equal(first_pass, np.concatenate([b.batch(i)[:, 0] for i in range(10)]))
    assert sorted(first_pass // 10) == list(range(40))  # every window once per pass
    assert not np.array_equal(first_pass, np.concatenate([c.batch(i)[:, 0] for i in range(10)]))


def test_token_files(tmp_path, tiny):
    tokens = (np.arange(5000) % 200).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.bin")), tokens)
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.npy")), tokens)
    train, val, _ = make_datasets(tiny(data=dict(path=str(tmp_path / "t.bin"))))
    assert len(train.tokens) + len(val.tokens) == 5000
    np.testing.assert_array_equal(val.tokens, tokens[-len(val.tokens) :])  # held-out tail
    with pytest.raises(ConfigError, match="no such file"):
        load_tokens(str(tmp_path / "missing.bin"))
    with pytest.raises(ConfigError, match="vocab_size"):
        make_datasets(
            tiny(
                data=dict(path=str(tmp_path / "t.bin")),
                model=dict(num_layers=2, d_model=32, num_heads=4, max_seq_len=32, vocab_size=100),
            )
        )


def test_embedded_corpus_is_deterministic_bytes():
    a, b = embedded_corpus(50_000), embedded_corpus(50_000)
    assert len(a) == 50_000 and a.max() < 256
    np.testing.assert_array_equal(a, b)
