"""A matrix kept as the product of two factors, A @ B, as TransformerLens's `FactoredMatrix`.

`model.QK` (W_Q W_K^T) and `model.OV` (W_V W_O) are [layer, head, d_model, d_model] matrices of
rank d_head: holding them factored keeps them at 2 * d_model * d_head numbers per head instead of
d_model^2, and every quantity people read off them (norm, singular values, eigenvalues, products
with embeddings) is computed from the factors:

- `norm()` (Frobenius) from two d_head x d_head Gram matrices: ||AB||^2 = tr((A^T A)(B B^T));
- `svd()` from QR decompositions of A and B^T and the SVD of the small middle factor;
- `eigenvalues` from B A (mdim x mdim), which has the nonzero eigenvalues of A B.

Same names and conventions as TransformerLens (`AB`, `BA`, `T`, `U`, `S`, `V`, `Vh` (which, as
there, is V, and deprecated), `collapse_l`, `collapse_r`, `make_even`, `get_corner`, `pair`, `@`
with tensors, vectors, other factored matrices and tensor-like objects), so `model.OV[1, 4].S` or
`(model.W_E @ model.QK[0, 2]) @ model.W_E.T` read as in a TransformerLens notebook. Shape errors
say what did not fit, and are also instances of what TransformerLens raises there (it asserts on
inner dimensions and lets torch's broadcasting raise on leading ones), so code that catches
either kind works: `FactoredShapeError` is a ValueError and an AssertionError,
`FactoredBroadcastError` a ValueError and a RuntimeError.
"""

from __future__ import annotations

import warnings
from functools import cached_property

import torch
from torch import Tensor


class FactoredShapeError(ValueError, AssertionError):
    """Operands whose matrix dimensions do not fit (inner dimensions, a non-square BA, a non-scalar
    `*`): TransformerLens raises AssertionError here, so this is one too."""


class FactoredBroadcastError(ValueError, RuntimeError):
    """Leading dimensions that do not broadcast: TransformerLens (through torch) raises RuntimeError."""


def _operand(x, like: Tensor):
    """A tensor, or a tensor-like object (anything with `ndim`, `shape` and `@`, as TransformerLens's
    `TensorLike` protocol) as it is; array-likes (lists, numpy arrays) become tensors in `like`'s
    dtype and device, so `OV @ numpy_array` works in float32 too."""
    if isinstance(x, Tensor) or (hasattr(x, "__matmul__") and hasattr(x, "ndim") and hasattr(x, "unsqueeze")):
        return x
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def _upcast(x: Tensor) -> Tensor:
    """Linear algebra needs float32 or float64 (half precision has no QR / SVD on CPU)."""
    return x if x.dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128) else x.float()


class FactoredMatrix:
    """A @ B with A [..., ldim, mdim], B [..., mdim, rdim]; leading dimensions broadcast."""

    __array_ufunc__ = None  # `numpy_array @ fm` hands over to __rmatmul__ instead of numpy's object arrays

    def __init__(self, A: Tensor, B: Tensor) -> None:
        # Only the tensor protocol is used here (ndim, shape, broadcast_to), so tensor-like factors work.
        if A.ndim < 2 or B.ndim < 2:
            raise FactoredShapeError(f"FactoredMatrix factors must be matrices (at least 2-d), got A {tuple(A.shape)}, B {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise FactoredShapeError(
                f"FactoredMatrix factors must match on the inner dimension: A {tuple(A.shape)} @ B {tuple(B.shape)}"
            )
        try:
            lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError as e:
            raise FactoredBroadcastError(
                f"FactoredMatrix: shape mismatch, the leading dimensions of A {tuple(A.shape)} and B {tuple(B.shape)} "
                "do not broadcast"
            ) from e
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.A = A.broadcast_to(lead + A.shape[-2:])
        self.B = B.broadcast_to(lead + B.shape[-2:])
        self.shape = torch.Size(lead + (self.ldim, self.rdim))
        self.has_leading_dims = len(lead) > 0

    # ---- shape ------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def pair(self) -> tuple[Tensor, Tensor]:
        return self.A, self.B

    def unsqueeze(self, k: int) -> "FactoredMatrix":
        """A new leading dimension at `k` (counted among the leading dimensions)."""
        if k < 0:
            k += self.ndim - 1
        if not 0 <= k <= self.ndim - 2:
            raise IndexError(f"unsqueeze({k}): a FactoredMatrix of shape {tuple(self.shape)} takes new leading dims at 0..{self.ndim - 2}")
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({tuple(self.shape)}), Hidden Dim({self.mdim})"

    # ---- products ---------------------------------------------------------------------------------
    @property
    def AB(self) -> Tensor:
        """The full matrix [..., ldim, rdim]."""
        return self.A @ self.B

    @property
    def BA(self) -> Tensor:
        """[..., mdim, mdim]; only for square matrices (ldim == rdim)."""
        if self.ldim != self.rdim:
            raise FactoredShapeError(f"BA needs a square matrix, this one is {self.ldim} x {self.rdim}")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        other = _operand(other, self.A)
        if other.shape[-2 if other.ndim >= 2 else -1] != self.rdim:
            raise FactoredShapeError(f"FactoredMatrix {tuple(self.shape)} @ {tuple(other.shape)}: inner dimensions differ")
        if other.ndim < 2:  # a vector: the result is a vector
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)
        # Keep the factorisation through its smaller side.
        return FactoredMatrix(self.A, self.B @ other) if self.rdim > self.mdim else FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other):
        other = _operand(other, self.A)
        if other.shape[-1] != self.ldim:
            raise FactoredShapeError(f"{tuple(other.shape)} @ FactoredMatrix {tuple(self.shape)}: inner dimensions differ")
        if other.ndim < 2:
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)
        return FactoredMatrix(other @ self.A, self.B) if self.ldim > self.mdim else FactoredMatrix(other, self.AB)

    def __mul__(self, scalar) -> "FactoredMatrix":
        if isinstance(scalar, Tensor) and scalar.numel() != 1:
            raise FactoredShapeError(f"FactoredMatrix * takes a scalar, got shape {tuple(scalar.shape)}; use @ for matrix products")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    # ---- spectra ----------------------------------------------------------------------------------
    @cached_property
    def _svd(self) -> tuple[Tensor, Tensor, Tensor]:
        # AB = Qa Ra Rb^T Qb^T with A = Qa Ra and B^T = Qb Rb (reduced QR); the SVD of the small
        # middle factor Ra Rb^T = Um S Vm^T gives U = Qa Um and V = Qb Vm.
        Qa, Ra = torch.linalg.qr(_upcast(self.A))
        Qb, Rb = torch.linalg.qr(_upcast(self.B).transpose(-2, -1))
        Um, S, Vmh = torch.linalg.svd(Ra @ Rb.transpose(-2, -1), full_matrices=False)
        return Qa @ Um, S, Qb @ Vmh.transpose(-2, -1)

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """(U [..., ldim, k], S [..., k], V [..., rdim, k]) with AB = U diag(S) V^T (k = mdim when
        ldim, rdim >= mdim). V, not V^T, as TransformerLens returns it."""
        return self._svd

    U = property(lambda self: self._svd[0])
    S = property(lambda self: self._svd[1])
    V = property(lambda self: self._svd[2])

    @property
    def Vh(self) -> Tensor:
        """V, not V^T: TransformerLens's old name for it, deprecated there (with the same warning class)."""
        warnings.warn("FactoredMatrix.Vh is V (the right singular vectors), not V^T; use .V "
                      "(TransformerLens deprecates .Vh too)", DeprecationWarning, stacklevel=2)
        return self._svd[2]

    @property
    def eigenvalues(self) -> Tensor:
        """The eigenvalues of AB that can be nonzero: those of BA [..., mdim] (complex)."""
        return torch.linalg.eigvals(_upcast(self.BA))

    def norm(self) -> Tensor:
        """Frobenius norm [...] from the factors: ||AB||_F^2 = tr((A^T A)(B B^T))."""
        A, B = _upcast(self.A), _upcast(self.B)
        gram_a = A.transpose(-2, -1) @ A
        gram_b = B @ B.transpose(-2, -1)
        return (gram_a * gram_b).sum((-2, -1)).clamp(min=0).sqrt()

    def collapse_l(self) -> Tensor:
        """S V^T [..., k, rdim]: the matrix with its left orthogonal factor U removed."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> Tensor:
        """U S [..., ldim, k]: the matrix with its right orthogonal factor removed."""
        return self.U * self.S[..., None, :]

    def make_even(self) -> "FactoredMatrix":
        """The same matrix as (U sqrt(S)) (sqrt(S) V^T): each factor carries half the spectrum."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.transpose(-2, -1))

    def get_corner(self, k: int = 3) -> Tensor:
        """The top-left k x k block of AB (and the first k entries of every leading dimension)."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(0, k) for _ in range(corner.dim() - 2))]

    # ---- indexing ---------------------------------------------------------------------------------
    def __getitem__(self, idx) -> "FactoredMatrix":
        """Index the leading dimensions (`OV[layer, head]`), and optionally rows, then columns, of
        the matrix; an integer row or column index keeps that dimension with size 1, so the result
        stays a FactoredMatrix."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is None for i in idx):
            raise IndexError("FactoredMatrix indices cannot add axes (None); use .unsqueeze(k)")
        if Ellipsis in idx:
            at = idx.index(Ellipsis)
            idx = idx[:at] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[at + 1:]
        lead = self.ndim - 2
        if len(idx) > self.ndim:
            raise IndexError(f"{len(idx)} indices for a FactoredMatrix of shape {tuple(self.shape)}")
        keep = lambda i: slice(i, i + 1 if i != -1 else None) if isinstance(i, int) else i
        head, rest = idx[:lead], [keep(i) for i in idx[lead:]]
        rows = rest[0] if rest else slice(None)
        cols = rest[1] if len(rest) > 1 else slice(None)
        return FactoredMatrix(self.A[head + (rows, slice(None))], self.B[head + (slice(None), cols)])


def _grams(left: FactoredMatrix, right: FactoredMatrix, dtype: torch.dtype):
    """What both composition scores read, in `dtype`: B_l, A_r, the Gram matrices G_l = A_l^T A_l and
    G_r = B_r B_r^T ([..., m, m]), and the Frobenius norms of the left and right products."""
    la, lb = left.A.to(dtype), left.B.to(dtype)
    ra, rb = right.A.to(dtype), right.B.to(dtype)
    gram_l = la.transpose(-2, -1) @ la
    gram_r = rb @ rb.transpose(-2, -1)
    norm_l = (gram_l * (lb @ lb.transpose(-2, -1))).sum((-2, -1)).clamp(min=0).sqrt()
    norm_r = (gram_r * (ra.transpose(-2, -1) @ ra)).sum((-2, -1)).clamp(min=0).sqrt()
    return lb, ra, gram_l, gram_r, norm_l, norm_r


def composition_scores(left: FactoredMatrix, right: FactoredMatrix, broadcast_dims: bool = True,
                       dtype: torch.dtype = torch.float64) -> Tensor:
    """||L R||_F / (||L||_F ||R||_F), the composition score of Elhage et al. (2021), computed in `dtype`.

    With `broadcast_dims` (TransformerLens's default) every left matrix meets every right one:
    [*left_lead, *right_lead]; without, the leading dimensions broadcast against each other. No
    [d_model, d_model] matrix is formed: ||A_l B_l A_r B_r||_F^2 = tr(P^T (A_l^T A_l) P (B_r B_r^T))
    with the small P = B_l A_r, so Q/K/V composition over every head pair of a model costs
    d_head x d_head products (taken in chunks to bound memory)."""
    if left.rdim != right.ldim:
        raise FactoredShapeError(f"composition of {tuple(left.shape)} with {tuple(right.shape)}: inner dimensions differ")
    lb, ra, gram_l, gram_r, norm_l, norm_r = _grams(left, right, dtype)

    def scores(gl, blk, gr, ar):
        P = blk @ ar
        return ((gl @ P) * (P @ gr)).sum((-2, -1)).clamp(min=0).sqrt()

    if not broadcast_dims:
        return scores(gram_l, lb, gram_r, ra) / (norm_l * norm_r)
    lead_l, lead_r = left.shape[:-2], right.shape[:-2]
    gl, blk = gram_l.reshape(-1, *gram_l.shape[-2:]), lb.reshape(-1, *lb.shape[-2:])
    gr, ar = gram_r.reshape(-1, *gram_r.shape[-2:]), ra.reshape(-1, *ra.shape[-2:])
    n_r = gr.shape[0]
    step = max(1, 2**24 // max(1, n_r * left.mdim * right.mdim))
    out = torch.cat([scores(gl[i:i + step, None], blk[i:i + step, None], gr[None], ar[None])
                     for i in range(0, gl.shape[0], step)])
    out = out / (norm_l.reshape(-1, 1) * norm_r.reshape(1, -1))
    return out.reshape(*lead_l, *lead_r)


def _psd_sqrt(gram: Tensor) -> Tensor:
    """The symmetric square root of PSD matrices [..., m, m] (eigenvalues clamped at 0), in float64."""
    vals, vecs = torch.linalg.eigh(gram.double())
    return (vecs * vals.clamp(min=0).sqrt()[..., None, :]) @ vecs.transpose(-2, -1)


def layered_composition_scores(left: FactoredMatrix, right: FactoredMatrix, dtype: torch.dtype = torch.float32,
                               budget: int = 1 << 24) -> Tensor:
    """[layer_a, head_a, layer_b, head_b] composition scores of every left head with every right head of a
    later layer (0 elsewhere), for `left` and `right` of shape [layer, head, d, d] (`all_composition_scores`).

    The same score as `composition_scores`, as one large matrix product per left layer: with symmetric
    square roots R = (A_l^T A_l)^(1/2) and S = (B_r B_r^T)^(1/2) (m x m each, from an eigendecomposition
    in float64), tr(P^T R^2 P S^2) = ||R P S||_F^2 and R P S = (R B_l)(A_r S). So the left heads' R B_l
    stacked [heads x m, d] times the later right heads' A_r S [d, heads x m] holds every pair's R P S as
    an m x m block, whose squared sum is the pair's ||L R||_F^2; no per-pair product of small matrices.
    Right layers are taken in chunks of at most `budget` output floats."""
    L, H = left.shape[:2]
    lb, ra, gram_l, gram_r, norm_l, norm_r = _grams(left, right, dtype)
    m_l, m_r = lb.shape[-2], ra.shape[-1]
    left_w = (_psd_sqrt(gram_l).to(dtype) @ lb).reshape(L, H * m_l, -1)  # [L, H m, d]
    right_w = (ra @ _psd_sqrt(gram_r).to(dtype)).permute(0, 2, 1, 3).reshape(L, -1, H * m_r)  # [L, d, H m]
    out = torch.zeros(L, H, L, H, dtype=dtype, device=lb.device)
    per = max(1, budget // max(1, H * m_l * H * m_r))  # right layers per product
    for a in range(L - 1):
        for b0 in range(a + 1, L, per):
            b1 = min(L, b0 + per)
            block = left_w[a] @ torch.cat(list(right_w[b0:b1]), dim=-1)  # [H m_l, (b1 - b0) H m_r]
            sq = block.view(H, m_l, b1 - b0, H, m_r).square().sum((1, 4))  # [H, b1 - b0, H]
            out[a, :, b0:b1] = sq.clamp(min=0).sqrt() / (norm_l[a][:, None, None] * norm_r[b0:b1][None])
    return out
