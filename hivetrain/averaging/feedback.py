"""Error feedback for compressed averaging: what a codec dropped from our contribution is sent in a later round
(the ``codecs`` module docstring says where it sits in a round)."""

from __future__ import annotations

import torch


class ErrorFeedback:
    """The error-feedback residual of one averager (EF-SGD, Karimireddy et al. 2019, Alg. 2): what the codec dropped
    from our last contribution, added to the next one so that the compression error is sent later instead of lost.

    Use per round: ``scratch = ef.apply(flat)`` adds the residual to our contribution ``flat`` (fp32, shape (n,), in
    place) and returns ``scratch`` (fp32 (n,)); the round writes ``sent - decode(encode(sent))`` of every slice it
    encodes into ``scratch``; then ``commit()`` if the round committed (the residual becomes ``scratch``),
    ``commit_exact()`` if our contribution was applied without encoding (a group of one), or nothing if it failed
    (the residual stays, so a retried round does not count it twice). Memory: two fp32 buffers of n elements.
    Not thread-safe: one object per averager, used by its one round thread.

    ``decay`` (β in (0, 1]) scales the residual before it is added: ``x + β·residual``. β = 1 is plain error feedback;
    β < 1 is SparseLoCo's decayed accumulator (Sarfi et al. 2025, Alg. 1: e ← β·e + Δ, send C(e), e ← e − C(e)),
    which forgets what stayed unsent for many rounds.

    Raises:
        ValueError: ``decay`` outside (0, 1].
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._residual: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

    def apply(self, flat: torch.Tensor) -> torch.Tensor:
        """Add the residual to ``flat`` in place and return the buffer for the new residual. A size change (another
        model) starts from a zero residual."""
        if self._residual is None or self._residual.numel() != flat.numel():
            self._residual = torch.zeros(flat.numel(), dtype=torch.float32)
            self._scratch = torch.zeros(flat.numel(), dtype=torch.float32)
        assert self._scratch is not None
        flat.add_(self._residual, alpha=self.decay)  # alpha = 1: x + 1·r is x + r, one rounding either way
        return self._scratch

    def commit(self) -> None:
        """The round committed: the residual it wrote into the scratch buffer becomes the residual."""
        self._residual, self._scratch = self._scratch, self._residual

    def commit_exact(self) -> None:
        """Our contribution (residual included) was applied exactly: nothing is left to send."""
        if self._residual is not None:
            self._residual.zero_()

    @property
    def residual(self) -> torch.Tensor | None:
        """The residual that the next ``apply`` adds (fp32 (n,)), or None before the first round."""
        return self._residual

    def reset(self) -> None:
        """Drop the residual (frees its memory)."""
        self._residual = self._scratch = None
