"""The attention slot's document mask (disttrain.attention), against attention run on
each document alone (torch SDPA, causal) and a mask written out element by element.

Tolerance 1e-6: the masked call and the per-document calls sum the same terms over the
same keys (masked keys add exact zeros); a key of another document moves outputs by
1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.attention import causal_sdpa, document_causal_mask
from disttrain.parallel.context.attention import _slot_ring

DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2, 2]])


def test_the_mask_lets_a_query_read_its_own_document_up_to_itself():
    mask = document_causal_mask(DOCS)
    assert mask.shape == (2, 1, 9, 9) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(9):
            for j in range(9):
                assert bool(mask[b, 0, i, j]) == (j <= i and DOCS[b, i] == DOCS[b, j])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_masked_attention_equals_each_document_alone(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 9, 8, generator=g) for _ in range(2))
    out = causal_sdpa(q, k, v, 0.0, DOCS)
    for b in range(2):
        for doc in DOCS[b].unique():
            at = (DOCS[b] == doc).nonzero().flatten()
            alone = F.scaled_dot_product_attention(
                q[b:b + 1, :, at], k[b:b + 1, :, at], v[b:b + 1, :, at], is_causal=True,
                enable_gqa=kv_heads != 4)
            torch.testing.assert_close(out[b:b + 1, :, at], alone, atol=1e-6, rtol=1e-6)
    # one document per row is plain causal attention
    torch.testing.assert_close(causal_sdpa(q, k, v, 0.0, torch.zeros(2, 9, dtype=torch.long)),
                               causal_sdpa(q, k, v, 0.0), atol=1e-6, rtol=1e-6)


def test_ring_attention_refuses_documents_instead_of_ignoring_them():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="parallel.cp = 1"):
        _slot_ring(q, q, q, 0.0, torch.zeros(1, 4, dtype=torch.long), comm=None, kernel=None)
