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

    @jax.jit  # one compiled program, not op by op (the tiles' loop eagerly took ~45 s)
    def outputs_and_grads(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, seg), q, k, v)
        return out, vjp(dout)

    out, grads = outputs_and_grads(q, k, v)
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


PROMPTS = (1, 1, 3, 4)  # each packed row's records' prompt lengths


def _chunk_run(n: int) -> tuple[dict, list]:
    """A tiny Llama's stage functions in ``n`` chunks of rows (offload.batch_chunks) on 4
    packed rows whose records have prompts of 1, 1, 3 and 4 tokens: the first chunk of
    2 rows takes a loss on more tokens than the second. -> every result of a step's
    block and head functions."""
    from hetjax.parallel.layouts import stage_layouts
    from hetjax.parallel.single import SingleDevice
    from hetjax.runtime.stages import functions as stages

    model = _model("llama", "blockwise")
    layouts = stage_layouts(model, 16 * 1024, leaf_buffers=True)
    fns = stages.StageFunctions(model, layouts, SingleDevice(), batch_chunks=n)
    rows = [_packed(_records(seed=r), prompt=p) for r, p in enumerate(PROMPTS)]
    tokens = np.concatenate([t for t, _ in rows])  # (4, 2, T)
    targets = np.concatenate([y for _, y in rows])  # (4, T)
    rng = np.random.default_rng(0)
    e, b, h = (
        jax.tree.map(
            jnp.asarray,
            layouts[s].leaf_views(rng.normal(0, 0.1, layouts[s].padded_size).astype(np.float32)),
        )
        for s in ("embed", "block", "head")
    )
    group = fns.groups[0]
    x, context = group.input_fwd(e, None, tokens, targets)
    y, stats = group.block_fwd(b, x, context)
    dy = jnp.asarray(rng.normal(0, 1, y.shape), jnp.float32)
    (db, _), dx, _ = group.block_bwd(b, x, dy, stats, context, group.zero_context(context))
    loss, (dh, _), (de, _), dhx = fns.head_fwd_bwd(h, e, y, targets, jnp.float32(1))
    evaluated = fns.head_loss(h, e, y, targets)
    halves = [float(fns.head_loss(h, e, y[k : k + 2], targets[k : k + 2])) for k in (0, 2)]
    return dict(y=y, db=db, dx=dx, loss=loss, dh=dh, de=de, dhx=dhx, eval=evaluated), halves


# ~10-25 s on 2 busy cores: the stage functions compiled twice; the default run's check
# is the weights' (below)
@pytest.mark.slow
def test_chunked_step_on_packed_rows_equals_the_whole_micro_batch():
    """offload.batch_chunks=2 on packed rows (a context of positions, loss weights that
    differ by chunk): every result equals the unchunked functions' (fp32, 1e-5): the
    loss is the micro-batch's mean over its completion tokens, not the mean of the two
    chunks' means, which differs here by more than 1e-3 (the check can fail)."""
    (whole, halves), (chunked, _) = _chunk_run(1), _chunk_run(2)
    assert_trees_close(chunked, whole, rtol=1e-5)
    # completion tokens of each half: 2 x (16 - 3 x 1) and (16 - 3 x 3) + (16 - 3 x 4)
    weights = np.array([26, 11]) / 37
    assert abs(float(whole["loss"]) - float(np.dot(weights, halves))) < 1e-5
    assert abs(float(whole["loss"]) - np.mean(halves)) > 1e-3


def test_chunk_loss_weights_by_hand():
    """Each chunk's weight in the micro-batch's mean: its targets that take a loss over
    the micro-batch's; rows 0-1 take 2 (0, 1), rows 2-3 take 4 (2, 3, 4 and 5)."""
    from hetjax.runtime.stages import chunks

    i = IGNORED
    targets = jnp.array([[0, 1, i, i], [i, i, i, i], [2, 3, 4, i], [5, i, i, i]])
    np.testing.assert_allclose(chunks.loss_weights(targets, 2), [2 / 6, 4 / 6], rtol=1e-7)
    np.testing.assert_allclose(chunks.loss_weights(targets, 4), [2 / 6, 0, 3 / 6, 1 / 6])
    np.testing.assert_array_equal(chunks.loss_weights(jnp.full((2, 4), i), 2), [0, 0])
    np.testing.assert_allclose(chunks.loss_weights(jnp.zeros((4, 3), int), 4), [0.25] * 4)


def test_t5_rows_by_hand():
    """T5's rows (instruct.pack_seq2seq), rows of 6, first fit in order while both sides
    fit: "ab" -> "c" (97 98 | 99) and 1 2 3 -> 4 5 share a row; 7 8 -> 9 does not fit
    its prompt (5 + 2 > 6): a new row; a prompt of 8 and a completion of 7 are each cut
    to 6 (counted), a row of their own. Rows: encoder ids | positions | decoder
    positions | targets, each side's padding a record of its own (positions from 0
    again, targets ignored). A record without a prompt is refused, naming its line."""
    from hetjax.config import ConfigError
    from hetjax.instruct import Record, pack_seq2seq

    i = IGNORED
    records = [
        Record((97, 98, 99), 2, 1, 2),
        Record((1, 2, 3, 4, 5), 3, 2, 3),
        Record((7, 8, 9), 2, 3, 2),
        Record(tuple(range(15)), 8, 4, 8),
    ]
    packed = pack_seq2seq(records, 6)
    expected = [
        [[97, 98, 1, 2, 3, 0], [0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2], [99, 4, 5, i, i, i]],
        [[7, 8, 0, 0, 0, 0], [0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4], [9, i, i, i, i, i]],
        [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]],
    ]
    np.testing.assert_array_equal(packed.rows, expected)
    assert (packed.records, packed.cut) == (4, 1)
    with pytest.raises(ConfigError, match="line 3: an encoder-decoder model"):
        pack_seq2seq([Record((1, 2), 1, 3, 0)], 4)


# ~10-20 s on 2 busy cores: T5's loss and gradient compiled twice
@pytest.mark.slow
def test_t5_packed_rows_equal_records_one_per_row():
    """T5 (2 encoder, 3 decoder blocks): three records packed into one row on both sides
    (instruct.pack_seq2seq) give the loss and every param's gradient of the same records
    one per row, each row's prompt padding masked (fp32, 1e-5)."""
    from hetjax.instruct import Record, pack_seq2seq

    model = build_model(
        Config().replace(
            model=dict(
                family="t5", num_layers=2, num_decoder_layers=3, d_model=32, num_heads=4,
                d_ff=64, relative_attention_num_buckets=8, relative_attention_max_distance=12,
                tie_embeddings=False,
            ),
            data=dict(objective="prefix_lm"),
            train=dict(seq_len=T),
        ).model
    )  # fmt: skip
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    shapes = [(5, 3), (7, 2), (4, 4)]  # (prompt, completion) tokens of each record
    records = [
        Record(tuple(rng.integers(1, 256, p + c).tolist()), p, r + 1, p)
        for r, (p, c) in enumerate(shapes)
    ]
    rows = pack_seq2seq(records, T).rows  # (1, 4, T): all three in one row
    assert rows.shape[0] == 1
    packed = (rows[:, :3], rows[:, 3])
    alone = np.zeros((3, 2, T), np.int32)  # one per row: ids, positions (padding from 0)
    targets = np.full((3, T), IGNORED, np.int32)
    for r, (rec, (p, c)) in enumerate(zip(records, shapes, strict=True)):
        alone[r, 0, :p] = rec.ids[:p]
        alone[r, 1] = np.concatenate([np.arange(p), np.arange(T - p)])
        targets[r, :c] = rec.ids[p:]
    loss_grad = jax.jit(jax.value_and_grad(model.loss))
    assert_trees_close(loss_grad(params, *packed), loss_grad(params, alone, targets))
