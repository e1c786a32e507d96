"""The demo's model: a tiny character-level transformer (pure torch) and its text, shipped as package data.

Small on purpose: two pre-norm layers of width 96 over a 64-character context train a few hundred steps on
two CPU cores in a minute or two, yet its loss visibly falls and its samples take the shape of words and lines. The
batches are a function of the step alone and dropout draws from torch's global RNG, so a resumed run
continues exactly where the checkpoint left off only if the RNG state was restored too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn

from dcs_tasks.sync.receiving import tensor_sha256

TEXT_RESOURCE = "data/sonnets.txt"


@dataclass(frozen=True)
class Corpus:
    """The training text as one tensor of character ids."""

    text: str
    chars: str
    ids: torch.Tensor

    @classmethod
    def load(cls) -> Corpus:
        text = resources.files("dcs_tasks.local").joinpath(TEXT_RESOURCE).read_text(encoding="utf-8")
        chars = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(chars)}
        return cls(text, chars, torch.tensor([index[c] for c in text], dtype=torch.long))

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, step: int, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets of `step` (the same for a given step in every process)."""
        gen = torch.Generator().manual_seed(step)
        starts = torch.randint(0, self.ids.numel() - context - 1, (batch,), generator=gen)
        window = torch.stack([self.ids[s : s + context + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        return [self.chars.index(c) for c in text if c in self.chars]


class CharTransformer(nn.Module):
    """Token + position embeddings, `layers` causal pre-norm transformer layers, a linear head."""

    mask: torch.Tensor

    def __init__(self, vocab: int, width: int = 96, heads: int = 4, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def make_model(vocab: int, seed: int = 0) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(vocab)


def train_step(model: CharTransformer, opt: torch.optim.Optimizer, corpus: Corpus, step: int, batch: int) -> float:
    """One optimizer step on the batch of `step`; returns the loss."""
    model.train()
    x, y = corpus.batch(step, batch, model.context)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over the weights, the optimizer state and torch's RNG state: equal digests mean a bit-exact
    training state."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}={tensor_sha256(t)}".encode())
    h.update(tensor_sha256(torch.get_rng_state()).encode())
    for index, values in sorted(opt.state_dict()["state"].items()):
        for key, value in sorted(values.items()):
            digest = tensor_sha256(value) if isinstance(value, torch.Tensor) else repr(value)
            h.update(f"{index}.{key}={digest}".encode())
    return h.hexdigest()


@torch.no_grad()
def sample(model: CharTransformer, corpus: Corpus, prompt: str, length: int, seed: int = 0) -> str:
    """`length` characters continuing `prompt` (temperature 0.8, a fixed seed: the same model, the same text)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = corpus.encode(prompt) or [0]
    for _ in range(length):
        window = torch.tensor([ids[-model.context :]])
        probs = torch.softmax(model(window)[0, -1] / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return corpus.decode(ids)


def training_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a checkpoint holds: weights, optimizer, step and RNG (enough to continue bit-exactly)."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}
