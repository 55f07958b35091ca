"""Packed rows (data.format=jsonl): several records in one row, each with its own
positions, attending only to itself. A packed row computes what its records compute run
one per row (losses and gradients, fp32 1e-5), in every attention implementation and
model family; the masked loss equals one computed by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import assert_trees_close

from hetjax.config import Config
from models import attention, build_model
from models.staged import IGNORED, token_loss

# three records of lengths 5, 7 and 4 packed in a row of 20 (4 tokens of padding)
LENGTHS = (5, 7, 4)
T = 20


def _records(vocab: int = 256, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in LENGTHS]


def _packed(records, prompt: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """One packed row: tokens (1, 2, T) (ids, positions) and targets (1, T), each
    record's first ``prompt`` targets and its last one ignored; padding a record of
    its own, ignored."""
    ids, pos, tgt = [], [], []
    for r in records:
        ids += list(r)
        pos += list(range(len(r)))
        t = [IGNORED] * (prompt - 1) + list(r[prompt:]) + [IGNORED]
        tgt += t
    pad = T - len(ids)
    ids += [0] * pad
    pos += list(range(pad))
    tgt += [IGNORED] * pad
    tokens = np.stack([ids, pos])[None].astype(np.int32)
    return tokens, np.asarray([tgt], np.int32)


def _one_per_row(records, prompt: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """The same records one per row, each row padded at its end (causal: the padding
    changes nothing before it), targets as :func:`_packed`'s."""
    n = max(LENGTHS)
    tokens = np.zeros((len(records), n), np.int32)
    targets = np.full((len(records), n), IGNORED, np.int32)
    for i, r in enumerate(records):
        tokens[i, : len(r)] = r
        targets[i, prompt - 1 : len(r) - 1] = r[prompt:]
    return tokens, targets


def test_token_loss_by_hand():
    """logits of 2 tokens over a vocabulary of 3: only the second token's target counts,
    its loss log(e^0 + e^1 + e^2) - 2, written out."""
    logits = jnp.array([[[5.0, 0.0, 0.0], [0.0, 1.0, 2.0]]])
    targets = jnp.array([[IGNORED, 2]])
    expected = math.log(1 + math.e + math.e**2) - 2.0
    assert abs(float(token_loss(logits, targets)) - expected) < 1e-6
    # every token counted: the plain mean, (log(e^5 + 2) - 5 + expected) / 2
    both = (math.log(math.e**5 + 2) - 5.0 + expected) / 2
    assert abs(float(token_loss(logits, jnp.array([[0, 2]]))) - both) < 1e-6


# default run: blockwise (the training path's); reference with -m slow (~8 s)
@pytest.mark.parametrize("impl", [pytest.param("reference", marks=pytest.mark.slow), "blockwise"])
def test_attention_within_a_record_equals_the_record_alone(impl):
    """Segment ids (records of 5, 7 and 4 plus padding): each record's outputs and the
    gradients of its q, k, v equal attention over that record alone (fp32, 1e-5)."""
    B, N, G, K = 1, 2, 2, 8
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, T, N, G, K))
    k = jax.random.normal(kk, (B, T, N, K))
    v = jax.random.normal(kv, (B, T, N, K))
    dout = jax.random.normal(kc, (B, T, N * G * K))
    seg = jnp.asarray(np.repeat(np.arange(4), [*LENGTHS, T - sum(LENGTHS)])[None], jnp.int32)
    if impl == "reference":
        run = lambda q, k, v, s: attention.reference_attention(q, k, v, s)
    else:  # tiles of 8: records cross tile edges, some tiles wholly masked for a row
        run = lambda q, k, v, s: attention.blockwise_attention(q, k, v, 8, s)
    out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, seg), q, k, v)
    grads = vjp(dout)
    start = 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        alone, vjp1 = jax.vjp(attention.reference_attention, q[:, sl], k[:, sl], v[:, sl])
        assert_trees_close(out[:, sl], alone)
        assert_trees_close([g[:, sl] for g in grads], list(vjp1(dout[:, sl])))
        start += n


def _model(family: str, impl: str):
    model = dict(family=family, num_layers=2, d_model=32, num_heads=4, max_seq_len=32,
                 attention=impl, attention_block=8)  # fmt: skip
    if family == "llama":
        model.update(num_kv_heads=2, tie_embeddings=False)
    if family == "mixtral":
        model.update(family="llama", num_kv_heads=2, num_experts=4, experts_per_token=2)
    return build_model(Config().replace(model=model, train=dict(seq_len=T)).model)


# ~15 s each on 2 busy cores (a model's loss and gradient compiled twice); the default
# run's check of packing is the attention's (above)
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, impl",
    [("llama", "blockwise"), ("gpt", "blockwise"), ("gpt", "reference"), ("llama", "reference")],
)
def test_packed_row_equals_records_one_per_row(family, impl):
    """The loss over the completion tokens and every param's gradient: one packed row
    of three records equals the three records one per row (fp32, 1e-5)."""
    model = _model(family, impl)
    params = model.init(jax.random.key(0))
    records = _records()
    packed = _packed(records)
    alone = _one_per_row(records)
    loss_grad = jax.jit(jax.value_and_grad(model.loss))
    assert_trees_close(loss_grad(params, *packed), loss_grad(params, *alone))
