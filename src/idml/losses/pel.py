"""PEL baseline: probabilistic embeddings with a Monte-Carlo match probability (HIB).

Oh et al. 2019 ("Modeling Uncertainty with Hedged Instance Embedding") — the IDML paper's
"uncertainty as a distribution" comparison point (PEL-MDW in its Table 2). Every image is a Gaussian
``N(μ_i, diag σ_i²)``; ``K`` reparameterised samples ``z_i^k = μ_i + σ_i ⊙ ε_i^k``, ``ε ~ N(0, I)``, give the
match probability of a pair::

    p_ij = mean_{k,k'} sigmoid(−a·||z_i^k − z_j^{k'}|| + b)       (a > 0 and b learned)

averaged over all ``K²`` sample pairs (HIB's estimator; ``sample_pairing="matched"`` averages over the
``K`` pairs ``(z_i^k, z_j^k)`` instead). The loss is the binary cross-entropy of ``p`` against "same
class" plus a KL prior term [K 8, weight 1e-4]::

    L = ½·mean_{(i,j)∈P} −log p_ij + ½·mean_{(i,j)∈N} −log(1 − p_ij)
        + w · mean_i KL(N(μ_i, σ_i²) ‖ N(0, I)),
    KL = ½ Σ_d (σ² + μ² − 1 − log σ²)

``P`` / ``N`` are the positive / negative pairs of the batch (set labels honoured, self-pairs excluded).
Positives and negatives are averaged separately, like :class:`~idml.losses.ContrastiveLoss`, so that the
few positive pairs of a DML batch are not drowned out; a batch without one kind uses the other alone.

**Input convention.** ``Embeddings(semantic=μ, uncertainty=log σ²)``: the semantic embedding is the
mean and the uncertainty embedding is the per-dimension *log-variance*, of the same shape. The model's
PEL head produces exactly that. All probabilities are computed in log space (``logsigmoid`` +
``logsumexp``), so ``p`` near 0 or 1 never produces ``log 0``.

Example:
    >>> import torch
    >>> samples = torch.tensor([[[0.0], [3.0]]])  # K = 1 sample of B = 2 one-dimensional images
    >>> p = match_probability(samples, scale=1.0, bias=3.0)
    >>> [round(v, 4) for v in p[0].tolist()]  # sigmoid(3 − 0), sigmoid(3 − 3)
    [0.9526, 0.5]
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from idml.embeddings import Embeddings
from idml.losses.base import MetricLoss, check_positive
from idml.losses.registry import LossContext, LossParams
from idml.metrics import EuclideanDistance, pairwise_squared_distance, safe_norm_from_squares
from idml.relations import LabelSets

SamplePairing = Literal["all", "matched"]
_PAIRINGS: tuple[str, ...] = ("all", "matched")


def _sample_distances(samples: Tensor, sample_pairing: SamplePairing) -> Tensor:
    """Euclidean distances between the samples of every pair of images.

    ``samples`` is ``(K, B, d)``; the result is ``(K, B, K, B)`` for ``"all"`` (entry
    ``[k, i, k', j] = ||z_i^k − z_j^{k'}||``) and ``(K, B, B)`` for ``"matched"``.
    """
    num_samples, batch, dim = samples.shape
    if sample_pairing == "all":
        flat = samples.reshape(num_samples * batch, dim)
        distance = safe_norm_from_squares(pairwise_squared_distance(flat, flat))
        return distance.view(num_samples, batch, num_samples, batch)
    squared_norms = samples.pow(2).sum(dim=2)
    squared = (
        squared_norms.unsqueeze(2)
        + squared_norms.unsqueeze(1)
        - 2.0 * torch.bmm(samples, samples.transpose(1, 2))
    )
    return safe_norm_from_squares(squared)


def _check_samples(samples: Tensor, sample_pairing: str) -> None:
    if sample_pairing not in _PAIRINGS:
        raise ValueError(f"sample_pairing must be one of {_PAIRINGS}, got {sample_pairing!r}")
    if samples.dim() != 3:
        raise ValueError(
            f"samples must have shape (num_samples, batch, dim), got {tuple(samples.shape)}"
        )


def _log_mean_sigmoid(logits: Tensor, sample_pairing: SamplePairing) -> Tensor:
    """``log mean sigmoid(ℓ)`` over the sample axes, as ``logsumexp(logsigmoid(ℓ)) − log(#pairs)``."""
    sample_dims = (0, 2) if sample_pairing == "all" else (0,)
    log_count = math.log(math.prod(logits.shape[d] for d in sample_dims))
    return torch.logsumexp(F.logsigmoid(logits), dim=sample_dims) - log_count


def match_log_probabilities(
    samples: Tensor,
    scale: Tensor | float,
    bias: Tensor | float,
    sample_pairing: SamplePairing = "all",
) -> tuple[Tensor, Tensor]:
    """``(log p, log(1 − p))`` of the HIB match probability (Oh et al. 2019), each ``(B, B)``.

    ``p_ij = mean sigmoid(−scale·||z_i − z_j|| + bias)`` over the sample pairs selected by
    ``sample_pairing`` (``"all"``: the ``K²`` pairs ``(k, k')``; ``"matched"``: the ``K`` pairs ``(k, k)``).
    Uses ``log mean sigmoid(ℓ) = logsumexp(logsigmoid(ℓ)) − log(#pairs)`` and
    ``1 − sigmoid(ℓ) = sigmoid(−ℓ)``, so neither tail underflows.

    Args:
        samples: ``(K, B, d)`` samples ``z_i^k``.
        scale: ``a > 0``.
        bias: ``b``.
        sample_pairing: ``"all"`` or ``"matched"``.
    """
    _check_samples(samples, sample_pairing)
    logits = -scale * _sample_distances(samples, sample_pairing) + bias
    return _log_mean_sigmoid(logits, sample_pairing), _log_mean_sigmoid(-logits, sample_pairing)


def match_probability(
    samples: Tensor,
    scale: Tensor | float,
    bias: Tensor | float,
    sample_pairing: SamplePairing = "all",
) -> Tensor:
    """HIB match probability ``p_ij`` (Oh et al. 2019) from ``(K, B, d)`` samples, shape ``(B, B)``.

    See :func:`match_log_probabilities` for the estimator.
    """
    return match_log_probabilities(samples, scale, bias, sample_pairing)[0].exp()


def gaussian_kl_to_standard(mean: Tensor, log_variance: Tensor) -> Tensor:
    """``KL(N(μ, diag σ²) ‖ N(0, I)) = ½ Σ_d (σ² + μ² − 1 − log σ²)`` per row, shape ``(B,)``.

    Example:
        >>> gaussian_kl_to_standard(torch.zeros(1, 3), torch.zeros(1, 3)).item()
        0.0
        >>> gaussian_kl_to_standard(torch.ones(1, 2), torch.zeros(1, 2)).item()  # ½·(1 + 1)
        1.0
    """
    return 0.5 * (log_variance.exp() + mean.pow(2) - 1.0 - log_variance).sum(dim=1)


class PELParams(LossParams):
    """PEL's Monte-Carlo samples, KL weight and the starting point of the match probability.

    ``μ`` is the L2-normalised semantic embedding, so sample distances lie in about ``[0, 2]``. The
    starting ``a = 8``, ``b = 8`` put the match boundary (``p = ½``) at distance 1 (cosine ½) with
    logits spanning ``[−8, 8]``; HIB's ``a = 1``, ``b = 0`` (unnormalised embeddings) would give every
    pair ``p ≤ ½`` and logits within two units, and on digits that run ended *below* the untrained
    network (MAP@R 28.1 vs 31.4; 42.5 with these values; ``tests/test_recipes.py``).
    """

    num_samples: int = Field(8, ge=1, description="samples K per image")
    kl_weight: float = Field(1e-4, ge=0, allow_inf_nan=False, description="weight w of the KL term")
    init_scale: float = Field(
        8.0, gt=0, allow_inf_nan=False, description="initial distance scale a (learned, > 0)"
    )
    init_bias: float = Field(
        8.0, allow_inf_nan=False, description="initial bias b (learned): p = ½ at distance b/a"
    )


_DEFAULT = PELParams()


class PELLoss(MetricLoss):
    """Probabilistic embedding loss of HIB (Oh et al. 2019): balanced BCE on ``p_ij`` + ``w``·KL.

    Args:
        num_samples: Monte-Carlo samples ``K ≥ 1`` per image [8].
        kl_weight: weight ``w ≥ 0`` of the KL prior term [1e-4].
        init_scale: initial ``a > 0`` (learned as ``log a`` so it stays positive) [8, see
            :class:`PELParams`].
        init_bias: initial ``b`` [8].
        sample_pairing: ``"all"`` (HIB's ``K²`` pairs, default) or ``"matched"`` (``K`` pairs).
        generator: random generator for the reparameterisation noise, for reproducible losses; the
            noise is drawn on the generator's device and moved to the embeddings' device.

    Input: ``Embeddings(semantic=μ, uncertainty=log σ²)`` with equal shapes (see the module docstring).
    The learned ``a`` and ``b`` are the parameters :attr:`log_scale` and :attr:`bias` of this module;
    give them to the optimiser with the model.
    """

    params = PELParams
    # HIB's comparison: the Euclidean distance of raw, unnormalised samples (computed for all K·B
    # samples at once by _sample_distances; the metric records it).
    default_metric = partial(EuclideanDistance, normalize=False)
    probabilistic = True
    repr_fields = ("num_samples", "kl_weight", "sample_pairing")

    def __init__(
        self,
        num_samples: int = _DEFAULT.num_samples,
        kl_weight: float = _DEFAULT.kl_weight,
        init_scale: float = _DEFAULT.init_scale,
        init_bias: float = _DEFAULT.init_bias,
        sample_pairing: SamplePairing = "all",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {num_samples}")
        if not (kl_weight >= 0 and math.isfinite(kl_weight)):
            raise ValueError(f"kl_weight must be a finite number >= 0, got {kl_weight}")
        check_positive("init_scale", init_scale)
        if not math.isfinite(init_bias):
            raise ValueError(f"init_bias must be a finite number, got {init_bias}")
        if sample_pairing not in _PAIRINGS:
            raise ValueError(f"sample_pairing must be one of {_PAIRINGS}, got {sample_pairing!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}"
            )
        self.num_samples = int(num_samples)
        self.kl_weight = float(kl_weight)
        self.sample_pairing: SamplePairing = sample_pairing
        self.generator = generator
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)))
        self.bias = nn.Parameter(torch.tensor(float(init_bias)))

    @classmethod
    def from_params(cls, params: PELParams, context: LossContext) -> PELLoss:
        """PEL brings its own comparison of samples: the context's metric is not used."""
        return cls(**params.model_dump())

    @property
    def scale(self) -> Tensor:
        """The distance scale ``a = exp(log_scale) > 0``."""
        return self.log_scale.exp()

    def sample(self, mean: Tensor, log_variance: Tensor) -> Tensor:
        """``K`` reparameterised samples ``μ + exp(½·log σ²) ⊙ ε``, shape ``(K, B, d)``."""
        shape = (self.num_samples, *mean.shape)
        if self.generator is None:
            noise = torch.randn(shape, dtype=mean.dtype, device=mean.device)
        else:
            noise = torch.randn(
                shape, generator=self.generator, dtype=mean.dtype, device=self.generator.device
            ).to(mean.device)
        return mean + torch.exp(0.5 * log_variance) * noise

    def match_probability(self, embeddings: Embeddings) -> Tensor:
        """Monte-Carlo ``p_ij`` between all images of a batch (e.g. for verification), ``(B, B)``."""
        mean, log_variance = self._gaussian(embeddings)
        samples = self.sample(mean, log_variance)
        return match_probability(samples, self.scale, self.bias, self.sample_pairing)

    def compute(self, embeddings: Embeddings, labels: LabelSets) -> Tensor:
        mean, log_variance = self._gaussian(embeddings)
        samples = self.sample(mean, log_variance)
        # One intersection matrix for both masks (positives exclude self-pairs).
        related = labels.intersects()
        positive, negative = related.clone().fill_diagonal_(False), ~related
        # Each pair needs only its own side: log p for positives, log(1 − p) = log mean sigmoid(−ℓ)
        # for negatives. Flipping the sign of ℓ per pair halves the work on the (K, B, K, B) logits.
        logits = -self.scale.to(mean.dtype) * _sample_distances(samples, self.sample_pairing)
        logits = logits + self.bias.to(mean.dtype)
        sign = torch.where(related, 1.0, -1.0).to(mean.dtype)
        sign = sign[None, :, None, :] if self.sample_pairing == "all" else sign
        log_likelihood = _log_mean_sigmoid(logits * sign, self.sample_pairing)
        parts = []
        if bool(positive.any()):
            parts.append(-log_likelihood[positive].mean())
        if bool(negative.any()):
            parts.append(-log_likelihood[negative].mean())
        kl = gaussian_kl_to_standard(mean, log_variance).mean()
        match = torch.stack(parts).mean() if parts else kl * 0.0
        return match + self.kl_weight * kl

    @staticmethod
    def _gaussian(embeddings: Embeddings) -> tuple[Tensor, Tensor]:
        log_variance = embeddings.uncertainty
        if log_variance is None or log_variance.shape != embeddings.semantic.shape:
            got = None if log_variance is None else tuple(log_variance.shape)
            raise ValueError(
                "PELLoss needs Embeddings(semantic=mean, uncertainty=log_variance) with equal shapes "
                f"(mean {tuple(embeddings.semantic.shape)}, log_variance {got}); use the model's PEL head"
            )
        return embeddings.semantic, log_variance
