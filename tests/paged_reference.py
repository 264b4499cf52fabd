"""A NumPy re-computation of PagedAttentionExecutor, independent of torch and the KV pool.

It recomputes attention over a sequence's whole token history in float64, the way the
executor's documentation describes the model, with no cache at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PagedModel:
    vocab_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 8

    def hidden(self, tokens: list[int]) -> np.ndarray:
        """Final hidden state at every position: [n, num_heads * head_dim]."""
        n, kvh, d, h = len(tokens), self.num_kv_heads, self.head_dim, self.num_heads
        width = kvh * d
        emb = np.zeros((n, width))
        emb[np.arange(n), np.asarray(tokens) % width] = 1.0
        kv = emb.reshape(n, kvh, d)
        group = h // kvh
        out = np.zeros((n, h, d))
        for head in range(h):
            x = kv[:, head // group, :]  # q = k = v for this head
            scores = x @ x.T / np.sqrt(d)
            scores[np.triu_indices(n, k=1)] = -np.inf  # position i sees 0..i
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[:, head, :] = p @ x
        return out.reshape(n, h * d)

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits at every position: [n, vocab]; logits[i mod vocab] += hidden element i."""
        hid = self.hidden(tokens)
        out = np.zeros((len(tokens), self.vocab_size))
        np.add.at(out, (slice(None), np.arange(hid.shape[1]) % self.vocab_size), hid)
        return out

    def last_logits(self, tokens: list[int]) -> np.ndarray:
        return self.logits(tokens)[-1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
