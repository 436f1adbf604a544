"""``dsa-indexer train-demo``: warm up a randomly initialised indexer against a small causal attention.

Each step draws a fresh packed batch of sequences. A token's features are the embedding of its id (from
a small vocabulary of random unit vectors) and sinusoidal position features; a fixed MQA attention
scores ``softmax_scale · attn_q_h·attn_k`` with heads that weigh "same token" and "nearby position"
differently, so its attention mass, summed over heads, concentrates on earlier copies of the token
and on recent keys: a pattern a ReLU indexer over the same features can learn. The indexer's
projections (``q``, ``k`` and the head weights, all linear in the features) start random and are
trained with Adam on ``indexer_kl_loss`` (dense stage). Every step reports the loss and the recall of
the indexer's top-k against the attention's own top-k (head-summed probabilities) over the rows that
see more than k keys; the batch is new each step, so the recall measures what generalises.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from . import indexer_kl_loss


@dataclass
class TrainDemoOptions:
    device: str = "cpu"
    steps: int = 120
    sequences: int = 4
    seq_len: int = 128
    topk: int = 16
    vocab: int = 12
    index_heads: int = 4
    index_dim: int = 16
    heads: int = 4
    lr: float = 2e-2
    seed: int = 0


@dataclass
class TrainDemoResult:
    options: TrainDemoOptions
    losses: list[float] = field(default_factory=list)
    recalls: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"losses": self.losses, "recalls": self.recalls, "seconds": self.seconds,
                "options": self.options.__dict__}


_EMBED, _POSITION = 16, 8


class _Task:
    """The data and the fixed main attention."""

    def __init__(self, options: TrainDemoOptions, generator: torch.Generator):
        self.options = options
        vocab = torch.randn(options.vocab, _EMBED, generator=generator)
        self.vocab = vocab / vocab.norm(dim=1, keepdim=True)
        # Per head: weight of token identity and of position (recency).
        self.head_mix = torch.tensor([[6.0, 0.5], [4.0, 2.0], [1.0, 4.0], [3.0, 3.0]])[: options.heads]
        self.frequencies = 1.0 / (2.0 ** torch.arange(_POSITION // 2, dtype=torch.float32))
        self.softmax_scale = 1.0

    @property
    def features(self) -> int:
        return _EMBED + _POSITION

    def batch(self, generator: torch.Generator):
        """Features ``x [T, F]``, main attention ``attn_q [T, H, F]``, ``attn_k [T, F]``, ``cu_seqlens``."""
        o = self.options
        ids = torch.randint(0, o.vocab, (o.sequences * o.seq_len,), generator=generator)
        positions = torch.arange(o.seq_len, dtype=torch.float32).repeat(o.sequences)
        angles = positions[:, None] * self.frequencies[None, :]
        x = torch.cat((self.vocab[ids], torch.cos(angles), torch.sin(angles)), dim=1)
        token_part = torch.cat((torch.ones(_EMBED), torch.zeros(_POSITION)))
        scale = self.head_mix[:, :1] * token_part + self.head_mix[:, 1:] * (1 - token_part)  # [H, F]
        attn_q = x[:, None, :] * scale[None]
        cu_seqlens = torch.arange(0, o.sequences + 1, dtype=torch.int32) * o.seq_len
        return x, attn_q, x.clone(), cu_seqlens

    def attention(self, attn_q, attn_k):
        """Causal per-sequence LSE ``[T, H]`` and the head-summed probabilities ``[B, L, L]``."""
        o = self.options
        q = attn_q.view(o.sequences, o.seq_len, o.heads, -1)
        k = attn_k.view(o.sequences, o.seq_len, -1)
        scores = torch.einsum("blhf,bsf->blhs", q, k) * self.softmax_scale
        causal = torch.ones(o.seq_len, o.seq_len, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal[None, :, None, :], float("-inf"))
        lse = scores.logsumexp(-1)
        probs = torch.exp(scores - lse[..., None]).sum(2)
        return lse.reshape(-1, o.heads).float(), probs


class _Indexer(torch.nn.Module):
    def __init__(self, features: int, options: TrainDemoOptions):
        super().__init__()
        self.heads, self.dim = options.index_heads, options.index_dim
        self.q_proj = torch.nn.Linear(features, self.heads * self.dim, bias=False)
        self.k_proj = torch.nn.Linear(features, self.dim, bias=False)
        self.w_proj = torch.nn.Linear(features, self.heads, bias=True)

    def forward(self, x):
        q = self.q_proj(x).view(-1, self.heads, self.dim)
        return q, self.k_proj(x), self.w_proj(x) * (self.heads * self.dim) ** -0.5


def _recall(q, k, w, probs, options: TrainDemoOptions) -> float:
    """Mean ``|indexer top-k ∩ attention top-k| / k`` over rows that see more than k keys."""
    o = options
    b, length = o.sequences, o.seq_len
    with torch.no_grad():
        qs, ks, ws = q.view(b, length, o.index_heads, -1), k.view(b, length, -1), w.view(b, length, -1)
        logits = torch.einsum("blj,bljs->bls", ws, torch.relu(torch.einsum("bljd,bsd->bljs", qs, ks)))
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
        target = probs.masked_fill(~causal, float("-inf"))
        rows = slice(o.topk, None)      # row p sees p + 1 keys
        mine = torch.zeros_like(target[:, rows], dtype=torch.bool).scatter_(2, logits[:, rows].topk(o.topk, 2).indices,
                                                                            True)
        theirs = torch.zeros_like(mine).scatter_(2, target[:, rows].topk(o.topk, 2).indices, True)
        return ((mine & theirs).sum().item()) / (mine.shape[0] * mine.shape[1] * o.topk)


def run_train_demo(options: TrainDemoOptions, progress=None) -> TrainDemoResult:
    """Train for ``options.steps`` steps; ``progress(step, loss, recall)`` is called after each one."""
    if options.topk >= options.seq_len:
        raise ValueError(f"topk must be < seq_len = {options.seq_len}, got {options.topk}")
    if options.heads > 4:
        raise ValueError(f"heads must be <= 4 (the demo attention has four head profiles), got {options.heads}")
    generator = torch.Generator().manual_seed(options.seed)
    torch.manual_seed(options.seed)
    task = _Task(options, generator)
    device = torch.device(options.device)
    indexer = _Indexer(task.features, options).to(device)
    optimizer = torch.optim.Adam(indexer.parameters(), lr=options.lr)
    result = TrainDemoResult(options)
    start = time.perf_counter()
    for step in range(options.steps):
        x, attn_q, attn_k, cu_seqlens = (t.to(device) for t in task.batch(generator))
        lse, probs = task.attention(attn_q, attn_k)
        q, k, w = indexer(x)
        loss = indexer_kl_loss(q, k, w, attn_q, attn_k, lse, softmax_scale=task.softmax_scale, cu_seqlens=cu_seqlens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result.losses.append(loss.item())
        result.recalls.append(_recall(q, k, w, probs, options))
        if progress is not None:
            progress(step, result.losses[-1], result.recalls[-1])
    result.seconds = time.perf_counter() - start
    if not all(math.isfinite(v) for v in result.losses):
        raise RuntimeError("the train demo's loss became non-finite")
    return result


def plot_train_demo(result: TrainDemoResult, path) -> None:
    """A PNG with the loss and the top-k recall against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    steps = range(1, len(result.losses) + 1)
    loss_axis.plot(steps, result.losses, color="tab:blue")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("indexer KL loss", color="tab:blue")
    recall_axis = loss_axis.twinx()
    recall_axis.plot(steps, result.recalls, color="tab:orange")
    recall_axis.set_ylabel(f"top-{result.options.topk} recall vs the attention", color="tab:orange")
    recall_axis.set_ylim(0, 1)
    loss_axis.set_title("dsa-indexer train-demo: indexer warm-up against a causal attention")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
