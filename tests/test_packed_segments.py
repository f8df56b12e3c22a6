"""Packed (THD) descriptors as FA3's variable-length sequences, on CPU: whether kv
segments are the query segments (`shared_segments`), the flash backend's rules for
packed configs, the sequences `flash_varlen` hands the kernels, and the descriptors
dispatch's measurement times packed and padded configs with."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn import SequenceDescriptor
from fusedattn.backends import flash, flash_varlen
from fusedattn.dispatch import measure
from fusedattn.validation import build_call

IDS = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]])


def test_one_set_of_ids_or_lengths_shares_the_segments():
    assert SequenceDescriptor.from_segment_ids(IDS, max_segments=3).shared_segments
    assert not SequenceDescriptor.from_segment_ids(IDS, IDS, max_segments=3).shared_segments
    lengths, offsets = jnp.array([[3, 2]]), jnp.array([[0, 3]])
    assert SequenceDescriptor.from_seqlens_offsets(lengths, offsets, q_len=8).shared_segments
    assert not SequenceDescriptor.from_seqlens_offsets(
        lengths, offsets, lengths, offsets, q_len=8, kv_len=8).shared_segments
    # (static: it survives jit as the kind does)
    seq = SequenceDescriptor.from_segment_ids(IDS, max_segments=3)
    assert jax.jit(lambda s: s)(seq).shared_segments


def _config(sequence, mask="none", window=None, dtype=jnp.bfloat16, d=128):
    x = jnp.zeros((2, 8, 2, d), dtype)
    return build_call(x, x, x, sequence=sequence, mask=mask, window=window)[0]


def test_flash_takes_packed_configs_whose_masks_it_aligns():
    shared = SequenceDescriptor.from_segment_ids(IDS, max_segments=3)
    own = SequenceDescriptor.from_segment_ids(IDS, IDS, max_segments=3)
    assert _config(shared).shared_segments and not _config(own).shared_segments
    for seq, mask, window in ((shared, "causal", None), (shared, "causal", (2, 0)),
                              (own, "none", None), (own, "causal_bottom_right", None)):
        assert flash.config_reason(_config(seq, mask, window)) is None, (mask, window)
    assert "aligns them bottom-right" in flash.config_reason(_config(own, "causal"))
    padding = SequenceDescriptor.from_lengths(jnp.array([8, 5]))
    assert "padding sequences" in flash.config_reason(_config(padding))


def test_varlen_sequences_cover_every_token_once():
    """Per row: its segments, its padded queries (against no key), its padded keys (for
    no query); starts ascend, and every token lies in exactly one used sequence."""
    lengths = jnp.array([[3, 2, 0], [4, 0, 0]])
    for side in (0, 1):
        starts, used = map(np.asarray, flash_varlen._segments(lengths, 8, side))
        assert starts.shape == (2 * 5 + 1,) and used.shape == (2 * 5,)
        assert np.all(np.diff(starts) >= 0) and starts[-1] == 16
        covered = np.zeros(16, int)
        for start, n in zip(starts[:-1], used):
            covered[start:start + n] += 1
        assert np.array_equal(covered, np.ones(16, int)), side
        pad_q, pad_k = used.reshape(2, 5)[:, 3], used.reshape(2, 5)[:, 4]
        assert list(pad_q if side == 0 else pad_k) == [3, 4]
        assert list(pad_k if side == 0 else pad_q) == [0, 0]


@pytest.mark.parametrize("kind", ["packed shared", "packed", "padding"])
def test_measurement_times_a_descriptor_of_the_configs_kind(kind):
    seq = {"packed shared": SequenceDescriptor.from_segment_ids(IDS, max_segments=3),
           "packed": SequenceDescriptor.from_segment_ids(IDS, IDS, max_segments=3),
           "padding": SequenceDescriptor.from_lengths(jnp.array([8, 5]))}[kind]
    config = _config(seq)
    timed = measure._sequence(config)
    again = _config(timed)   # a valid descriptor of the same kind (validation runs)
    assert dataclasses.replace(again, score_mod=None) == dataclasses.replace(config, score_mod=None)
    if config.is_packed:
        assert np.asarray(timed.q_lengths).sum(axis=1).tolist() == [8, 8]


def test_varlen_sequences_stay_inside_the_rows_whatever_the_lengths():
    """Traced lengths are checked only when run in checked mode: lengths summing past the
    row still give sequences inside it (never an access past the tokens)."""
    starts, used = map(np.asarray, jax.jit(
        lambda n: flash_varlen._segments(n, 8, 0))(jnp.array([[3, 2], [6, 6]])))
    assert np.all(np.diff(starts) >= 0) and np.all(used >= 0)
    assert np.all(starts[:-1] + used <= 16)

