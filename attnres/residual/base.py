"""The one interface every residual scheme implements.

A scheme is an ``nn.Module`` that owns its parameters. ``begin(embedding)``
starts one forward pass and returns a ``Stream`` that the model drives:

    stream = scheme.begin(x)              # x = token embedding, [B, T, D]
    for l in range(L):                    # L = 2 * n_layers sublayers
        h = stream.read(l)                # input of sublayer l (before its pre-norm)
        stream.write(l, f_l(norm_l(h)))   # its output
    y = stream.end()                      # goes to the final norm and the LM head

The model never asks which scheme it holds. Streams must be driven in this
order; they check it, because a silently skipped write would corrupt the
depth history.

Between two sublayers a stream can be handed to another pipeline stage:
``stream.export()`` returns ``(history, state)``, and on the receiving side
``scheme.resume(l, history, state)`` continues at sublayer l. ``history`` is
the append-only part of the depth state (the embedding and completed block
representations): every later sublayer reads it and nothing changes it, so a
stage that already holds a prefix of it need not receive that prefix again
(docs/method.md §7's cross-stage caching). ``state`` is the running part (a partial
block sum, the hidden state, the extra streams), sent at every transition.

The same hand-over carries the depth state between Transformer blocks. ``scheme.start(x)`` returns
a ``DepthState``: the next sublayer's index and the tensors of the state (history, running state and
the fast forms' derived tensors). A block resumes a stream from it, runs its sublayers and returns
``stream.depth()``; nothing but tensors crosses the block's boundary, so per-block wrappers
(``fully_shard``, ``checkpoint_wrapper``, ``torch.compile``) see an ordinary module:

    depth = scheme.start(x)
    for block in blocks:                  # inside each block:
        depth = block(depth)              #   stream = scheme.stream(depth)
    y = scheme.finish(depth)              #   stream.apply(sublayer) per sublayer; return stream.depth()

Measurement stays out of the arithmetic: a stream only computes. Observers
(``attnres.residual.observe``: the depth record, residual I/O counting) attach
to it and see each read, write and end, and may wrap the tensor operations in
``stream.ops`` to count what they move.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from attnres.ops.common import RMSNormArgs
from attnres.ops.depth_attention import depth_attention_reference, fused_depth_attention
from attnres.ops.gated_depth_attention import gated_depth_attention
from attnres.ops.rms_norm import plain_rms_norm, rms_norm
from attnres.ops.token_queries import merge_partial_token, phase1_token_queries
from attnres.ops.two_phase import reference as two_phase_reference
from attnres.ops.two_phase.compiled import phase1_sources
from attnres.ops.two_phase.fused import merge, merge_norm, merge_partial, phase1_outputs
from attnres.residual import record


def widened(f: Tensor, stream: Tensor) -> Tensor:
    """A sublayer output ``f`` in the precision of the ``stream`` it enters: the wider of the two dtypes, as
    PreNorm's h + f promotes. Under autocast a sublayer returns bfloat16 while the embedding stays float32;
    kept in bfloat16, a running sum would round at every write and each source's gradient would be summed
    over its readers in bfloat16. Same dtypes (float32 in, or a bfloat16 model): ``f`` itself, uncopied."""
    wide = torch.promote_types(f.dtype, stream.dtype)
    return f if f.dtype == wide else f.to(wide)


def unviewed(t: Tensor) -> Tensor:
    """``t``, or where it is a view that autograd tracks, its storage as a tensor of its own (no copy).

    What a stream exports is often such a view: a sublayer's output kept as a source or partial sum
    (``nn.Linear`` on [B, T, D] views its 2-D product), and under FSDP2 every source a block received,
    which its pre-forward hook returns as views of themselves. FSDP2 warns for every view a wrapped block
    returns, because an in-place op on one would drop its backward hook; the stream never writes into its
    sources, so the alias is safe. Compiled graphs and tensors without gradients pass as they are (FSDP2
    hooks only tensors that require grad)."""
    if torch.compiler.is_compiling() or not t.requires_grad or t._base is None:
        return t
    return torch.ops.aten._unsafe_view(t, t.shape)


def store_row(buffer: Tensor, row: int, v: Tensor) -> None:
    """buffer[:, :, row] = v, outside autograd (the buffer is a read-only view for the ops)."""
    with torch.no_grad():
        buffer[:, :, row].copy_(v)


@dataclass(frozen=True)
class StreamOps:
    """The tensor operations a stream's arithmetic is made of, as one table an observer can wrap.

    ``accumulate(s, f)``: a running sum s + f. ``store(buffer, row, v)``: a completed source copied
    into a preallocated buffer. The rest are the depth-attention ops of ``attnres.ops``;
    ``phase1`` reads the buffer, ``phase1_sources`` the sources as separate tensors (the form
    compiled streams use, ``COMPILED_OPS``).
    """

    accumulate: Callable = operator.add
    store: Callable = store_row
    phase1: Callable = phase1_outputs
    phase1_sources: Callable = phase1_sources
    merge: Callable = merge
    merge_norm: Callable = merge_norm  # a read that is a merge (Full AttnRes inside a group), and its norm
    merge_partial: Callable = merge_partial
    attend: Callable = fused_depth_attention
    attend_reference: Callable = depth_attention_reference
    phase1_token: Callable = phase1_token_queries  # Phase 1 / 2 with per-token (low-rank) queries
    merge_partial_token: Callable = merge_partial_token
    gated: Callable = gated_depth_attention  # the gated multi-head rival (attnres.residual.gated)


PLAIN_OPS = StreamOps()
# what a stream traced by torch.compile for training runs: plain autograd, which inductor fuses and
# differentiates itself (attnres.ops.two_phase.compiled says why)
COMPILED_OPS = StreamOps(merge_partial=two_phase_reference.merge_partial, merge_norm=two_phase_reference.merge_norm)


class DepthState(NamedTuple):
    """The depth state between two sublayers, as tensors: what a Transformer block receives and returns.

    ``at``: the next sublayer to read. ``history``: the append-only sources (embedding, completed
    depth blocks), ``state``: the running part (``Stream.export``'s pair). ``cache``: tensors a fast
    form derives from the history and reuses across blocks (a source buffer, inverse RMS, the current
    group's Phase-1 statistics); dropping it is always correct, keeping it saves their recomputation.
    A NamedTuple of tensors, so ``torch.utils._pytree`` (FSDP2, checkpointing) sees every tensor.
    """

    at: int
    history: tuple[Tensor, ...]
    state: tuple[Tensor, ...]
    cache: tuple[Tensor, ...] = ()


class Stream:
    """One forward pass through a residual scheme. Subclasses implement _read/_write/_end/_export.

    ``at``: the sublayer being read or written (L during the final aggregation), for observers.
    """

    ops: StreamOps = PLAIN_OPS
    token_shape: tuple[int, ...] | None = None  # [B, T, D], set by begin / resume: what write checks

    def __init__(self, n_sublayers: int):
        self.n_sublayers = n_sublayers
        self.observers: list = []
        self.at = 0
        self._next = 0
        self._reading = False

    def read(self, l: int | None = None, norm: nn.Module | None = None) -> Tensor:
        """The input h_l of sublayer ``l`` (default: the next one), before its pre-norm; with ``norm``
        (the sublayer's pre-norm module) norm(h_l), which a stream may compute in one pass with its read
        (two-phase AttnRes fuses Phase 2 with a plain ``nn.RMSNorm``; ``attnres.ops.rms_norm``). Observers
        that read inputs see h_l either way (with one attached nothing is fused)."""
        l = self._next if l is None else l
        if l == self._next >= self.n_sublayers and not self._reading:
            raise ValueError(
                f"stream.read({l}) / stream.apply: call {l + 1} for a scheme built with n_sublayers="
                f"{self.n_sublayers} (sublayers 0 … {self.n_sublayers - 1}, all run); build the scheme with "
                "n_sublayers = the sublayers your model runs through it (2 per attention + MLP block), or call "
                "stream.end()"
            )
        if l != self._next or self._reading:
            raise RuntimeError(f"stream.read({l}) out of order: expected read({self._next})")
        self._reading = True
        self.at = l
        args = plain_rms_norm(norm) if norm is not None else None
        if args is not None and not any(observer.reads_inputs for observer in self.observers):
            x = self._read_normed(l, args)
            if x is not None:
                return x
        h = self._read(l)
        for observer in self.observers:
            observer.after_read(self, l, h)
        if norm is None:
            return h
        return rms_norm(h, args) if args is not None else norm(h)

    def write(self, l: int | None, f: Tensor) -> None:
        """Sublayer ``l``'s output f_l (``l`` None: the sublayer just read)."""
        l = self._next if l is None else l
        if l != self._next or not self._reading:
            raise RuntimeError(f"stream.write({l}) out of order: expected read({self._next}) first")
        if self.token_shape is not None and tuple(f.shape) != self.token_shape:
            raise ValueError(
                f"stream.write({l}, f): f has shape {tuple(f.shape)}, the stream's tokens are "
                f"{list(self.token_shape)} [B, T, D]; a sublayer must return one vector per token"
            )
        self._reading = False
        self._next += 1
        self.at = l
        for observer in self.observers:
            observer.before_write(self, l, f)
        self._write(l, f)

    def apply(self, sublayer: Callable[[Tensor], Tensor], norm: nn.Module | None = None) -> Tensor:
        """Run the next sublayer: ``f = sublayer(read())``, written back; returns f. With ``norm``, the
        sublayer's pre-norm: ``f = sublayer(norm(read()))``, the norm computed with the read
        (``read(norm=...)``)."""
        f = sublayer(self.read(norm=norm))
        self.write(None, f)
        return f

    def end(self) -> Tensor:
        if self._next != self.n_sublayers:
            raise RuntimeError(f"stream.end() after {self._next} of {self.n_sublayers} sublayers")
        self.at = self.n_sublayers
        for observer in self.observers:
            observer.before_end(self)
        return self._end()

    def export(self) -> tuple[list[Tensor], list[Tensor]]:
        """(history, state) between two sublayers, for a pipeline transition (see the module doc)."""
        if self._reading:
            raise RuntimeError(f"stream.export() between read({self._next}) and its write")
        return self._export()

    def depth(self) -> DepthState:
        """The state between two sublayers as a ``DepthState`` (the export plus the derived cache)."""
        history, state = self.export()
        return DepthState(self._next, tuple(history), tuple(state), tuple(self._cache()))

    def state_bytes(self) -> int:
        """Bytes of depth history this stream keeps beyond the one running state every scheme
        has (block representations, Full AttnRes' sources, block outputs, extra streams);
        0 for single-state schemes."""
        return 0

    def depth_weights(self, l: int) -> tuple[Tensor, list[str]] | None:
        """The depth weights sublayer l (L = the final aggregation) reads its sources with, [K, B, T]
        (or [K, B, T, H]), and the sources' names; None for schemes without depth weights. Called
        between read(l) and write(l), or just before end()."""
        return None

    # -- to implement
    def _read_normed(self, l: int, norm: RMSNormArgs) -> Tensor | None:
        """norm(h_l) computed together with the read, or None where this stream has no such path (the
        default: ``read`` then applies the norm to h_l)."""
        return None

    def _read(self, l: int) -> Tensor:
        raise NotImplementedError

    def _write(self, l: int, f: Tensor) -> None:
        raise NotImplementedError

    def _end(self) -> Tensor:
        raise NotImplementedError

    def _export(self) -> tuple[list[Tensor], list[Tensor]]:
        raise NotImplementedError

    def _cache(self) -> Sequence[Tensor]:
        """Derived tensors worth handing to the next block (``DepthState.cache``, given back to the
        scheme's ``_resume``); none by default."""
        return ()


class ResidualScheme(nn.Module):
    """Base class of residual schemes: owns parameters, starts streams.

    Subclasses implement ``_begin(embedding)`` and ``_resume(history, state, cache)``; ``begin`` and
    ``resume`` attach the observers (``record``, and those registered with
    ``attnres.residual.observe.observing``). ``settings()`` says what defines the function; the state
    dict saves it (``attnres.residual.record``) and a load into other settings fails.
    """

    n_sublayers: int  # L, set by each subclass
    scheme_name: str = "?"  # its RESIDUALS name, set by each subclass

    def __init__(self):
        super().__init__()
        self.observers: list = []  # attached to every stream this scheme starts

    def begin(self, embedding: Tensor, record=None) -> Stream:
        """Start a forward pass at the embedding [B, T, D]. ``record``: a ``DepthRecord`` to fill."""
        if not isinstance(embedding, Tensor) or embedding.dim() != 3 or not embedding.is_floating_point():
            found = (
                f"a {embedding.dim()}-D {embedding.dtype} tensor of shape {tuple(embedding.shape)}"
                if isinstance(embedding, Tensor)
                else type(embedding).__name__
            )
            raise ValueError(
                f"{type(self).__name__}.begin(embedding): expected a floating tensor [B, T, D], got {found}"
            )
        d = getattr(self, "d_model", None)
        if d is not None and embedding.shape[-1] != d:
            raise ValueError(
                f"{type(self).__name__}.begin(embedding): last dimension {embedding.shape[-1]} is not "
                f"d_model={d}; build the scheme with d_model={embedding.shape[-1]} or pass [B, T, {d}]"
            )
        stream = self._begin(embedding)
        stream.token_shape = tuple(embedding.shape)
        return self._observed(stream, record)

    def resume(
        self, at: int, history: Sequence[Tensor], state: Sequence[Tensor], record=None, cache: Sequence[Tensor] = ()
    ) -> Stream:
        """Continue, at sublayer ``at``, a stream that another stage exported after sublayer at - 1
        (``cache``: what ``Stream.depth()`` derived besides, or nothing)."""
        stream = (
            self._resume(list(history), list(state), tuple(cache))
            if cache
            else self._resume(list(history), list(state))
        )
        if not 0 <= at <= stream.n_sublayers:
            raise ValueError(f"resume at sublayer {at}: the scheme has {stream.n_sublayers} sublayers (0 … L)")
        stream._next = stream.at = at
        held = list(history) or list(state)
        stream.token_shape = tuple(held[0].shape[-3:]) if held else None
        return self._observed(stream, record)

    def start(self, embedding: Tensor, record=None) -> DepthState:
        """The depth state before sublayer 0 (``begin(embedding).depth()``)."""
        return self.begin(embedding, record=record).depth()

    def stream(self, depth: DepthState, record=None) -> Stream:
        """A stream that continues from ``depth`` (a block's way in; ``stream.depth()`` is its way out)."""
        if type(depth) is not DepthState:  # a stream, a tensor, or a tuple that lost its type: say which
            raise TypeError(not_a_depth_state(depth))
        return self.resume(depth.at, depth.history, depth.state, record=record, cache=depth.cache)

    def finish(self, depth: DepthState, record=None) -> Tensor:
        """The final aggregation after the last sublayer: what goes to the final norm and the head."""
        return self.stream(depth, record=record).end()

    def _observed(self, stream: Stream, record) -> Stream:
        from attnres.residual.observe import DepthRecorder

        for observer in self.observers:
            observer.attach(stream)
        if record is not None:
            DepthRecorder(record).attach(stream)
        return stream

    def _begin(self, embedding: Tensor) -> Stream:
        raise NotImplementedError

    def _resume(self, history: list[Tensor], state: list[Tensor], cache: tuple[Tensor, ...] = ()) -> Stream:
        """``cache``: what the exporting stream's ``_cache()`` derived (empty for streams that derive
        nothing); ``resume`` passes it only when there is some."""
        raise NotImplementedError

    def prenorm_read_scale(self, l: int) -> float | None:
        """c, where at initialisation read l returns c times the PreNorm residual sum (1 for PreNorm
        itself); None where the scheme does not compute a multiple of it at init."""
        return None

    def norm_eps_scale(self, l: int) -> float:
        """Factor on the eps of the norm that reads sublayer l's input (l = L: the final norm); 1
        unless a scheme rescales its reads (AttnRes' ``attnres_scale_norm_eps``)."""
        return 1.0

    def no_weight_decay(self) -> list[str]:
        """Names (relative to this module) of parameters the trainer must not decay: all of ours."""
        return [name for name, _ in self.named_parameters()]

    # -- what the state dict records (attnres.residual.record)
    def settings(self) -> dict[str, Any]:
        """What defines this scheme's function, by ``ModelConfig`` field name (JSON values): saved with its
        weights and compared on load. Choices of how it is computed (``attnres_impl``) and of the
        initialisation alone are left out; ``norm_eps`` is restored on load rather than compared."""
        return {"n_sublayers": self.n_sublayers}

    def get_extra_state(self) -> Tensor:
        return record.encode(record.record_of(self))

    def set_extra_state(self, state: Any) -> None:
        saved = record.decode(state, f"the state dict of {type(self).__name__}")
        problem = record.mismatch(self, saved)
        if problem is not None:
            raise record.SchemeMismatch(problem)
        record.restore(self, saved)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        key = prefix + record.RECORD_KEY
        problem = record.mismatch(self, record.decode(state_dict[key], key)) if key in state_dict else None
        if problem is not None:
            if any(k.startswith(prefix) and k != key for k in state_dict):
                raise record.SchemeMismatch(problem)  # before any weight is copied
            # a state dict with none of this scheme's weights (a PreNorm model's, loaded with strict=False into
            # an AttnRes model to start from its sublayers): the scheme takes nothing from it, its settings neither
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        recorded = key in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
        if not recorded and key in missing_keys:
            missing_keys.remove(key)  # saved before schemes kept a record: the model's own settings hold


def record_keys(model: nn.Module) -> dict[str, ResidualScheme]:
    """State-dict key of each residual scheme's record in ``model`` -> the scheme."""
    return {
        f"{prefix}.{record.RECORD_KEY}" if prefix else record.RECORD_KEY: module
        for prefix, module in model.named_modules()
        if isinstance(module, ResidualScheme)
    }


def check_records(model: nn.Module, tensors: Mapping[str, Tensor]) -> str | None:
    """The first scheme of ``model`` whose record in ``tensors`` names other settings, as ``mismatch``'s line
    (or the record that cannot be read); None where every record fits or is absent (saved before records)."""
    for key, scheme in record_keys(model).items():
        if key in tensors:
            try:
                problem = record.mismatch(scheme, record.decode(tensors[key], key))
            except record.SchemeMismatch as e:
                problem = str(e)
            if problem is not None:
                return problem
    return None


def not_a_depth_state(depth: Any, where: str = "residual.stream(depth) / residual.finish(depth)") -> str:
    """The one-line error for a call (``where``) whose ``depth`` is something else than a ``DepthState``:
    what it is, and the usual way it got there."""
    if isinstance(depth, Stream):
        what, fix = f"the stream itself ({type(depth).__name__})", "end each block with `return stream.depth()`"
    elif isinstance(depth, Tensor):
        what = f"a tensor {list(depth.shape)}"
        fix = "begin with depth = residual.start(x) and pass on what each block returns"
    elif type(depth) is tuple and len(depth) == 4:
        what = "a plain tuple: a DepthState that torch.utils.checkpoint(use_reentrant=True) returned without its type"
        fix = "that drops its gradients too; checkpoint blocks with attnres.checkpoint_block(block, depth, residual)"
    else:
        what, fix = f"a {type(depth).__name__}", "pass what residual.start(x) or the previous block returned"
    return f"{where}: depth is {what}, not a DepthState; {fix}"
