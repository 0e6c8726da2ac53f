"""Which tokens an AoT task moves most (paper section 4.3): per layer, the rows of P with the largest L2 norm."""

from __future__ import annotations

import torch

from aot.training.methods.aot_ptuning.model import AotBody
from aot.training.model import TaskModel


@torch.no_grad()
def row_norms(model: TaskModel, chunk: int = 4096) -> torch.Tensor:
    """||P^i_x|| for every token x and layer i, [V, L], computed chunk by chunk (never the whole table)."""
    body = model.body
    if not isinstance(body, AotBody):
        raise ValueError("inspect needs an AoT task (method fc or kron)")
    vocab = body.embeddings.shape[0]
    norms = []
    for start in range(0, vocab, chunk):
        ids = torch.arange(start, min(start + chunk, vocab), device=body.embeddings.device)
        norms.append(body.rows(ids).float().norm(dim=-1).cpu())
    return torch.cat(norms)


def top_tokens(model: TaskModel, tokenizer, k: int) -> list[list[tuple[str, float]]]:
    """For each layer, the k (token, norm) pairs with the largest norm."""
    norms = row_norms(model)
    k = min(k, norms.shape[0])
    result = []
    for layer in range(norms.shape[1]):
        values, ids = norms[:, layer].topk(k)
        tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
        result.append([(tok, float(v)) for tok, v in zip(tokens, values, strict=True)])
    return result
