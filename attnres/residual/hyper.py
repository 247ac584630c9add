"""Multi-stream residuals: Hyper-Connections (static and dynamic) and mHC.

The state is n parallel residual streams H = [H_0 … H_{n-1}], kept as one
tensor [n, B, T, D]. ``begin`` copies the embedding into every stream. For
sublayer l:

    read(l):      x = sum_j pre_j H_j                        (the sublayer input)
    write(l, f):  H'_k = sum_j R[k, j] H_j + post_k f        (mix the streams, add f)
    end():        sum_j H_j                                  (collapse, as in the HC paper)

The final RMSNorm makes the collapse's scale irrelevant: sum and mean give
the same logits up to norm eps. The coefficients for write(l) are computed in
read(l) from the same (pre-update) streams.

``hyper`` (Zhu et al., 2025, Hyper-Connections; Algorithm 2 of the paper):
static matrices A_m (n), A_r (n x n), B (n), initialised as the paper's
PreNorm-equivalent: A_m = e_{l mod n} (sublayer l reads stream l mod n),
A_r = I, B = 1. Then all streams stay equal to the PreNorm state, so step 0
equals ``prenorm`` exactly (the end sum is n times the PreNorm state). With
``hyper_dynamic`` (DHC, the default) each stream j adds input-dependent terms
from its own unit-RMS view u_j = H_j / rms(H_j):

    [pre_j, R[:, j]] = A_m[j], A_r[j, :] + s_a * tanh(u_j W_a)      W_a: d x (n + 1)
    post_j           = B[j]              + s_b * tanh(u_j w_b)      w_b: d

W_a, w_b start at zero, s_a = s_b = 0.01 (so step 0 is still PreNorm); in
our notation R[k, j] = A_r[j, k]. The paper's LayerNorm is an RMS
normalisation without gain here: a gain in front of W would be redundant.

``mhc`` (Xie et al., 2025, Manifold-Constrained Hyper-Connections), with the
streams flattened per token into x = vec(H) in R^{n d} and u = x / rms(x):

    pre  = sigmoid(a_pre  * (u phi_pre)  + b_pre)                         [n]
    post = 2 sigmoid(a_post * (u phi_post) + b_post)                      [n]
    R    = Sinkhorn(exp(a_res * mat(u phi_res) + b_res))                  [n x n]

Sinkhorn-Knopp alternates row and column normalisation ``mhc_sinkhorn_iters``
(20) times in float32 or wider, so R is doubly stochastic: each new stream is
a convex mix of the old ones and their total is preserved. Initialisation
(our choice where the paper leaves it open; documented in ``MHC_INIT``):
phi = 0 and a = 0.01 (the paper's gating-factor init), so at step 0 the
coefficients are the static ones:

- b_post = 0: post = 1, every stream receives f (HC's B = 1);
- b_res = 0 on the diagonal, -2 elsewhere: R is symmetric, hence exactly
  doubly stochastic, and diagonal-dominant (each stream keeps
  1/(1 + (n-1)e^-2) = 0.71 of itself for n = 4; HC's A_r = I in spirit).
  Not sharper on purpose: Sinkhorn-Knopp converges slowly on near-permutation
  matrices. After 20 iterations, logits perturbed by N(0, 0.1^2) around this
  init give row sums within ~1e-7 of 1 (~1e-5 for N(0, 0.3^2)); around a -4
  gap (0.95 diagonal) they are already off by ~1e-3, and a trained, sharp
  mixer keeps gaps of that size (column sums are always exact: the last step
  normalises them). ``mhc_sinkhorn_iters`` trades time for exactness;
- b_pre = +2 on stream l mod n, -2 elsewhere: pre = (0.88, 0.12, …), mostly
  reading one stream like HC's one-hot A_m. This breaks the symmetry between
  streams: with identical streams, uniform pre and symmetric R every stream
  would get the same gradient forever and mHC would collapse to one stream.

Since the streams start equal, pre's positive weights only rescale the
sublayer input (undone by the sublayer's RMSNorm), and rows of R sum to 1,
step 0 computes exactly the ``prenorm`` function (up to norm eps).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnres.ops.common import autocast_disabled
from attnres.residual.base import ResidualScheme, Stream, widened
from attnres.residual.scaled import unit_rms

HC_DYNAMIC_SCALE_INIT = 0.01
MHC_INIT = dict(alpha=0.01, pre_on=2.0, pre_off=-2.0, post=0.0, res_diag=0.0, res_off=-2.0)


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp on exp(logits) over the last two dims: rows, then columns, ``iters`` times.

    Runs in float32 or wider (float64 stays float64). Subtracting the max first is
    exact: the first row normalisation removes any common factor.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(dtype)
    m = torch.exp(z - z.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


class MultiStream(Stream):
    """n streams [n, B, T, D]; the scheme supplies per-sublayer coefficients."""

    def __init__(self, scheme: _MultiStreamScheme, embedding: Tensor):
        super().__init__(scheme.n_sublayers)
        self.scheme = scheme
        self.H = embedding.unsqueeze(0).expand(scheme.n_streams, *embedding.shape)
        self._coeffs: tuple[Tensor, Tensor] | None = None  # (post, res) of the last read

    def _read(self, l: int) -> Tensor:
        pre, post, res = self.scheme.coefficients(l, self.H)
        self._coeffs = (post, res)
        dt = self.H.dtype
        with autocast_disabled(self.H.device.type):  # the streams stay in their own precision, as PreNorm's
            if pre.dim() == 1:
                return torch.einsum("j,jbtd->btd", pre.to(dt), self.H)
            return torch.einsum("btj,jbtd->btd", pre.to(dt), self.H)

    def _write(self, l: int, f: Tensor) -> None:
        assert self._coeffs is not None  # Stream.write runs only after the read that set them
        post, res = self._coeffs
        self._coeffs = None
        dt = self.H.dtype
        f = widened(f, self.H)
        with autocast_disabled(self.H.device.type):
            if res.dim() == 2:
                mixed = torch.einsum("kj,jbtd->kbtd", res.to(dt), self.H)
                self.H = mixed + post.to(dt)[:, None, None, None] * f
            else:
                mixed = torch.einsum("btkj,jbtd->kbtd", res.to(dt), self.H)
                self.H = mixed + post.to(dt).permute(2, 0, 1).unsqueeze(-1) * f

    def _end(self) -> Tensor:
        return self.H.sum(0)

    def _export(self):
        return [], [self.H]

    def state_bytes(self) -> int:
        # n streams, of which one stands for the running state every scheme has
        one = self.H[0]
        return (self.H.shape[0] - 1) * one.numel() * one.element_size()


class _MultiStreamScheme(ResidualScheme):
    def __init__(self, config, n_streams: int):
        super().__init__()
        self.n_sublayers = config.n_sublayers
        self.d_model = config.d_model
        self.n_streams = n_streams
        self.eps = config.norm_eps

    def settings(self) -> dict:
        return {"n_sublayers": self.n_sublayers, "d_model": self.d_model, "norm_eps": self.eps}

    def coefficients(self, l: int, H: Tensor):
        """(pre, post, res) for sublayer l: pre [n] or [B, T, n]; post likewise; res [n, n] or
        [B, T, n, n] with res[k, j] = weight of old stream j in new stream k."""
        raise NotImplementedError

    def _begin(self, embedding: Tensor) -> Stream:
        return MultiStream(self, embedding)

    def _resume(self, history, state, cache=()):
        stream = MultiStream(self, state[0][0])
        stream.H = state[0]
        return stream


class HyperConnectionResidual(_MultiStreamScheme):
    """Hyper-Connections: static (SHC) or static + dynamic (DHC) connection matrices."""

    scheme_name = "hyper"

    def settings(self) -> dict:
        return {**super().settings(), "hyper_streams": self.n_streams, "hyper_dynamic": self.dynamic}

    def __init__(self, config):
        n = config.hyper_streams
        super().__init__(config, n)
        L, d = self.n_sublayers, self.d_model
        self.dynamic = config.hyper_dynamic
        a_m = torch.zeros(L, n)
        a_m[torch.arange(L), torch.arange(L) % n] = 1.0
        self.static_pre = nn.Parameter(a_m)  # A_m
        self.static_res = nn.Parameter(torch.eye(n).repeat(L, 1, 1))  # A_r[j, k]
        self.static_post = nn.Parameter(torch.ones(L, n))  # B
        if self.dynamic:
            self.dynamic_alpha = nn.Parameter(torch.zeros(L, d, n + 1))  # W_a: [A_m | A_r row]
            self.dynamic_beta = nn.Parameter(torch.zeros(L, d))  # w_b
            self.alpha_scale = nn.Parameter(torch.full((L,), HC_DYNAMIC_SCALE_INIT))
            self.beta_scale = nn.Parameter(torch.full((L,), HC_DYNAMIC_SCALE_INIT))

    def coefficients(self, l: int, H: Tensor):
        if not self.dynamic:
            return self.static_pre[l], self.static_post[l], self.static_res[l].t()
        dtype = torch.promote_types(H.dtype, torch.float32)
        with autocast_disabled(H.device.type):
            u = unit_rms(H.to(dtype), self.eps)  # [n, B, T, D], per stream
            a = self.alpha_scale[l].to(dtype) * torch.tanh(u @ self.dynamic_alpha[l].to(dtype))
            b = self.beta_scale[l].to(dtype) * torch.tanh(u @ self.dynamic_beta[l].to(dtype))
            pre = (a[..., 0] + self.static_pre[l].to(dtype)[:, None, None]).permute(1, 2, 0)
            # a[j, b, t, 1 + k] adds to A_r[j, k]; res[b, t, k, j] = A_r[j, k]
            a_r = a[..., 1:] + self.static_res[l].to(dtype)[:, None, None, :]
            res = a_r.permute(1, 2, 3, 0)
            post = (b + self.static_post[l].to(dtype)[:, None, None]).permute(1, 2, 0)
        return pre, post, res


class ManifoldHyperConnectionResidual(_MultiStreamScheme):
    """mHC: sigmoid pre/post maps and a Sinkhorn-projected (doubly stochastic) stream mixer."""

    scheme_name = "mhc"

    def settings(self) -> dict:
        return {**super().settings(), "mhc_streams": self.n_streams, "mhc_sinkhorn_iters": self.iters}

    def __init__(self, config):
        n = config.mhc_streams
        super().__init__(config, n)
        L, d = self.n_sublayers, self.d_model
        self.iters = config.mhc_sinkhorn_iters
        init = MHC_INIT
        self.phi_pre = nn.Parameter(torch.zeros(L, n * d, n))
        self.phi_post = nn.Parameter(torch.zeros(L, n * d, n))
        self.phi_res = nn.Parameter(torch.zeros(L, n * d, n * n))
        b_pre = torch.full((L, n), init["pre_off"])
        b_pre[torch.arange(L), torch.arange(L) % n] = init["pre_on"]
        self.bias_pre = nn.Parameter(b_pre)
        self.bias_post = nn.Parameter(torch.full((L, n), init["post"]))
        b_res = torch.full((n, n), init["res_off"])
        b_res.fill_diagonal_(init["res_diag"])
        self.bias_res = nn.Parameter(b_res.repeat(L, 1, 1))
        self.gate = nn.Parameter(torch.full((L, 3), init["alpha"]))  # a_pre, a_post, a_res

    def coefficients(self, l: int, H: Tensor):
        n = self.n_streams
        dtype = torch.promote_types(H.dtype, torch.float32)
        with autocast_disabled(H.device.type):
            x = H.to(dtype).permute(1, 2, 0, 3).flatten(2)  # [B, T, n D]: vec of the n x D state
            u = unit_rms(x, self.eps)
            g = self.gate[l].to(dtype)
            pre = torch.sigmoid(g[0] * (u @ self.phi_pre[l].to(dtype)) + self.bias_pre[l].to(dtype))
            post = 2 * torch.sigmoid(g[1] * (u @ self.phi_post[l].to(dtype)) + self.bias_post[l].to(dtype))
            logits = g[2] * (u @ self.phi_res[l].to(dtype)).unflatten(-1, (n, n)) + self.bias_res[l].to(dtype)
            res = sinkhorn(logits, self.iters)
        return pre, post, res


def hyper_params(config) -> int:
    """Per sublayer: static A_m, A_r, B (n + n^2 + n); dynamic adds W_a d(n + 1), w_b d, 2 scales."""
    n, d = config.hyper_streams, config.d_model
    per = n + n * n + n
    if config.hyper_dynamic:
        per += d * (n + 1) + d + 2
    return config.n_sublayers * per


def mhc_params(config) -> int:
    """Per sublayer: phi (n d x (2n + n^2)), biases (2n + n^2), three gating factors."""
    n, d = config.mhc_streams, config.d_model
    return config.n_sublayers * (n * d * (2 * n + n * n) + 2 * n + n * n + 3)
