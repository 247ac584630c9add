"""Observers: the depth record and residual I/O counting, outside the streams' arithmetic."""

import pytest
import torch

from attnres import AttnResLM, ModelConfig
from attnres.residual import DepthRecord, IOCounter, StreamObserver, observing

SIZES = dict(vocab_size=64, d_model=32, n_layers=5, n_heads=2, max_seq_len=16)

# Per-sublayer residual I/O (index L = 10: the final aggregation), in d-vectors per token, as the
# counts written inline in the streams' arithmetic gave them before the counting moved into an
# observer (commit 95b432d): the observer must reproduce them exactly.
IO_BEFORE = {
    "prenorm": ({"residual": "prenorm"}, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]),
    "block": (
        {"residual": "block", "attnres_blocks": 4},
        [1, 4, 5, 2, 4, 5, 3, 4, 5, 5, 5],
        [3, 2, 3, 3, 2, 3, 3, 2, 3, 2, 1],
    ),
    "block-fused": (
        {"residual": "block", "attnres_blocks": 4, "attnres_impl": "fused"},
        [1, 4, 5, 2, 5, 6, 3, 6, 7, 5, 5],
        [1, 2, 3, 1, 2, 3, 1, 2, 3, 2, 1],
    ),
    "full": ({"residual": "full"}, [2, 4, 5, 5, 4, 5, 8, 4, 5, 11, 11], [4, 3, 3, 4, 3, 3, 4, 3, 3, 2, 1]),
    "full-window": (
        {"residual": "full", "attnres_window": 3},
        [2, 3, 4, 5, 5, 5, 5, 5, 5, 5, 4],
        [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1],
    ),
}


@pytest.mark.parametrize("name", list(IO_BEFORE))
def test_io_counter_reproduces_the_inline_counts(name):
    overrides, reads, writes = IO_BEFORE[name]
    model = AttnResLM(ModelConfig(**SIZES, **overrides))
    with observing(model.residual, IOCounter()) as counter, torch.no_grad():
        model(torch.randint(0, 64, (1, 3)))
    assert (counter.reads, counter.writes) == (reads, writes)
    assert not model.residual.observers  # detached after the block


def test_io_counter_sees_only_the_residual_arithmetic_and_changes_nothing():
    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(**SIZES, residual="block", attnres_blocks=4)).double()
    x = torch.randint(0, 64, (2, 5))
    plain = model(x)
    with observing(model.residual, IOCounter()):
        counted = model(x)
    assert torch.equal(plain, counted)
    # streams started after the block are not counted
    assert model(x).dtype == torch.float64 and not model.residual.observers


class _Order(StreamObserver):
    def __init__(self):
        self.events = []

    def after_read(self, stream, l, h):
        self.events.append(("read", l, stream.at))

    def before_write(self, stream, l, f):
        self.events.append(("write", l, stream.at))

    def before_end(self, stream):
        self.events.append(("end", stream.at))


def test_observer_hooks_fire_in_stream_order_for_every_scheme():
    for residual in ("prenorm", "block", "full", "mhc", "denseformer"):
        model = AttnResLM(ModelConfig(**SIZES, residual=residual))
        with observing(model.residual, _Order()) as order, torch.no_grad():
            model(torch.randint(0, 64, (1, 3)))
        L = model.config.n_sublayers
        expected = [e for l in range(L) for e in (("read", l, l), ("write", l, l))] + [("end", L)]
        assert order.events == expected, residual


def test_depth_record_through_the_observer():
    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(**SIZES, residual="block", attnres_block_size=3)).double()
    record = model(torch.randint(0, 64, (2, 4)), return_record=True).record
    assert isinstance(record, DepthRecord)
    L = model.config.n_sublayers
    assert len(record.weights) == len(record.sources) == L + 1
    assert len(record.input_rms) == len(record.output_rms) == L
    assert record.sources[0] == ["emb"] and record.sources[4] == ["emb", "b1", "b2~"]
    for w, names in zip(record.weights, record.sources, strict=True):
        assert w.shape == (len(names), 2, 4)
        torch.testing.assert_close(w.sum(0), torch.ones(2, 4))
    prenorm = AttnResLM(ModelConfig(**SIZES, residual="prenorm"))
    record = prenorm(torch.randint(0, 64, (1, 3)), return_record=True).record
    assert record.weights == [None] * (L + 1) and len(record.input_rms) == L
