"""`interp.FactoredMatrix` against TransformerLens 4's `FactoredMatrix` on the same factors, and
against the product formed explicitly (norms, spectra, indexing, products)."""

from __future__ import annotations

import pytest
import torch

from interp.models.readouts.factored import FactoredMatrix, composition_scores

tl_fm = pytest.importorskip("transformer_lens.FactoredMatrix")


def factors(*lead, l=12, m=4, r=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, l, m, generator=g, dtype=torch.float64), torch.randn(*lead, m, r, generator=g, dtype=torch.float64)


def close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() < tol


def test_products_and_norms_match_transformer_lens():
    A, B = factors(3, 2)
    ours, theirs = FactoredMatrix(A, B), tl_fm.FactoredMatrix(A, B)
    assert ours.shape == theirs.shape == torch.Size([3, 2, 12, 10]) and ours.ndim == 4 and ours.mdim == 4
    close(ours.AB, theirs.AB)
    close(ours.T.AB, theirs.T.AB)
    close(ours.norm(), theirs.norm())
    close(ours.norm(), ours.AB.flatten(-2).norm(dim=-1))  # the Frobenius norm, from the factors alone
    close(ours.S, theirs.S)
    close(ours.S, torch.linalg.svdvals(ours.AB)[..., :4])
    U, S, V = ours.svd()
    close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), ours.AB)  # V, not V^T, as TransformerLens
    close(U.transpose(-2, -1) @ U, torch.eye(4).expand(3, 2, 4, 4).double())
    with pytest.warns(DeprecationWarning, match="Vh is V"):  # TransformerLens's old name, deprecated as there
        close(ours.Vh, V)
    close(ours.U @ ours.collapse_l(), ours.AB)
    close(ours.collapse_r() @ ours.V.transpose(-2, -1), ours.AB)
    even = ours.make_even()
    close(even.AB, ours.AB)
    close(even.A.norm(dim=-2), even.B.norm(dim=-1))  # each side carries sqrt(S)
    close(ours.get_corner(2), theirs.get_corner(2))
    close((ours * 2.5).AB, (theirs * 2.5).AB)
    close((2.5 * ours).AB, 2.5 * ours.AB)
    close(ours.unsqueeze(1).AB, theirs.unsqueeze(1).AB)
    # square: BA and eigenvalues (the nonzero ones of AB)
    sq = FactoredMatrix(*factors(2, l=9, m=3, r=9, seed=1))
    sq_tl = tl_fm.FactoredMatrix(sq.A, sq.B)
    close(sq.BA, sq_tl.BA)
    mags = lambda e: e.abs().sort(dim=-1).values
    close(mags(sq.eigenvalues), mags(sq_tl.eigenvalues), 1e-8)
    full = mags(torch.linalg.eigvals(sq.AB))  # 9 eigenvalues, 6 of them zero
    close(mags(sq.eigenvalues), full[..., -3:], 1e-8)
    assert full[..., :-3].max() < 1e-8
    with pytest.raises(ValueError, match="square"):
        FactoredMatrix(*factors()).BA


def test_matmul_matches_transformer_lens():
    A, B = factors(2)
    ours, theirs = FactoredMatrix(A, B), tl_fm.FactoredMatrix(A, B)
    g = torch.Generator().manual_seed(3)
    right_wide = torch.randn(10, 7, generator=g, dtype=torch.float64)
    left_wide = torch.randn(5, 12, generator=g, dtype=torch.float64)
    vec_r, vec_l = torch.randn(10, generator=g, dtype=torch.float64), torch.randn(12, generator=g, dtype=torch.float64)
    for o, t in ((ours @ right_wide, theirs @ right_wide), (left_wide @ ours, left_wide @ theirs)):
        assert isinstance(o, FactoredMatrix)
        close(o.AB, t.AB)
    close(ours @ vec_r, theirs @ vec_r)
    close(ours @ vec_r, ours.AB @ vec_r)
    close(vec_l @ ours, vec_l @ ours.AB)
    other = FactoredMatrix(*factors(2, l=10, m=3, r=6, seed=4))
    close((ours @ other).AB, ours.AB @ other.AB)
    close((ours @ other).AB, (theirs @ tl_fm.FactoredMatrix(other.A, other.B)).AB)
    with pytest.raises(ValueError, match="inner dimensions"):
        ours @ torch.randn(11, 3)
    with pytest.raises(ValueError, match="inner dimension"):
        FactoredMatrix(torch.randn(5, 3), torch.randn(4, 5))


@pytest.mark.parametrize("idx", [1, (2, 1), (slice(0, 2),), (1, 0, 3), (1, 0, slice(2, 5)), (1, 0, 3, 4),
                                 (0, 1, slice(None), 7), (Ellipsis, 2), (-1, -1, -1, -1), ([0, 2],)])
def test_indexing_matches_transformer_lens(idx):
    A, B = factors(3, 2)
    ours, theirs = FactoredMatrix(A, B)[idx], tl_fm.FactoredMatrix(A, B)[idx]
    assert isinstance(ours, FactoredMatrix)
    close(ours.AB, theirs.AB)


def test_composition_scores_against_explicit_products():
    left = FactoredMatrix(*factors(2, 3, l=16, m=4, r=16, seed=5))
    right = FactoredMatrix(*factors(4, l=16, m=4, r=16, seed=6))
    got = composition_scores(left, right)
    assert got.shape == (2, 3, 4)
    for i in range(2):
        for j in range(3):
            for k in range(4):
                L, R = left.AB[i, j], right.AB[k]
                close(got[i, j, k], (L @ R).norm() / (L.norm() * R.norm()))
    paired = composition_scores(left[:, 0], FactoredMatrix(right.A[:2], right.B[:2]), broadcast_dims=False)
    close(paired, torch.stack([got[0, 0, 0], got[1, 0, 1]]))
    from transformer_lens.utilities import composition_scores as tl_scores

    close(got, tl_scores(tl_fm.FactoredMatrix(left.A, left.B).unsqueeze(2),
                         tl_fm.FactoredMatrix(right.A, right.B).unsqueeze(0).unsqueeze(0), broadcast_dims=False).squeeze())
