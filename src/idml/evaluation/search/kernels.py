"""Which matrix product computes the score tiles on this CPU: measured, not assumed.

The same fp32 product ``Q·Rᵀ`` runs at very different speeds through different BLAS libraries on
the same CPU. On a 2-core AMD EPYC (AVX-512) one fp32 pass of ``x·xᵀ`` at SOP scale took 37.4 s
through torch (MKL, which takes a slower path on non-Intel CPUs) and 22.0 s through NumPy
(OpenBLAS); on Intel machines MKL is the fast one. So the engine measures its candidate kernels
on the machine it runs on (:func:`choose_kernels`, once per process and tile shape) instead of
assuming a vendor:

* ``torch`` — fp32 through torch (MKL or oneDNN on x86 builds, cuBLAS on CUDA);
* ``openblas`` — fp32 through NumPy's BLAS (OpenBLAS in the NumPy wheels);
* ``faiss`` — fp32 through faiss's ``pairwise_distances`` (its own BLAS), when faiss is installed;
* ``bf16`` — a *screening* product in bfloat16 (AVX-512 BF16 or AMX CPUs run it several times
  faster than fp32), whose scores are only used to list candidates with a proven margin; every
  candidate is then re-scored exactly in fp32 (:func:`rescore_pairs`), so results stay exact.

The fastest fp32 kernel computes every exact score (the band of relevant scores, and tiles that
are not screened). The ``bf16`` screen is used when its product is at least
:data:`SCREEN_MIN_GAIN` times faster than that fp32 kernel: below that, the wider candidate lists
and the re-scoring eat the gain.

**The screening margin (derivation).** Let ``q, r ∈ ℝᵈ``, ``e`` the exact engine's fp32 score of
the pair and ``a`` the screen's. bfloat16 keeps an 8-bit significand: rounding to it has unit
roundoff ``u = 2⁻⁸``. The screen multiplies the rounded rows ``q̃, r̃`` (each product exact in
fp32), sums in fp32 to ``s̃`` and rounds ``s̃`` to bfloat16: ``a = fl(s̃)``. With ``γ_d = d·2⁻²⁴ /
(1 − d·2⁻²⁴)`` bounding an fp32 sum of ``d`` terms and Cauchy–Schwarz,

    |s̃ − q̃·r̃| ≤ γ_d‖q̃‖‖r̃‖,   |q̃·r̃ − q·r| ≤ ‖q̃‖‖r̃ − r‖ + ‖q̃ − q‖‖r‖,   |e − q·r| ≤ γ_d‖q‖‖r‖,

so ``|s̃ − e| ≤ m`` with ``m`` the sum of the right-hand sides, computed per query from the
actual rounding errors ``‖x̃ − x‖`` of its rows (about ``u/√3·‖x‖``, half the worst case) and the
largest of the tile's references (:class:`Screen`). Rounding to bfloat16 is monotone and
``|a − s̃| ≤ u|s̃|``; hence

* a pair whose exact score reaches ``t`` has ``a ≥ (t − m) − u|t − m|`` (:meth:`Screen.reach`);
* a pair screened at ``a`` has an exact score of at least ``a − u|a|/(1 − u) − m``
  (:meth:`Screen.lower_bound`).

For unit vectors of dimension 512 the worst case of ``m`` plus the output rounding is
:func:`screen_margin` = 0.0118. At start-up the measurement also checks the kernel's worst error
on its test product against that bound (a library that accumulated in bfloat16 would exceed it
and is never used).

Example:
    >>> round(screen_margin(512), 4)
    0.0118
    >>> choose_kernels(torch.device("cpu"), 64, 64, requested="torch").describe()
    'torch (fp32)'
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch
from torch import Tensor

KernelName = Literal["auto", "torch", "openblas", "faiss", "bf16"]
"""``auto`` measures; the others force one kernel (``bf16``: screened by bfloat16, exact by the
fastest fp32 kernel)."""

EXACT_KERNELS = ("torch", "openblas", "faiss")
SCREEN_KERNELS = ("bf16",)
KERNEL_NAMES = ("auto", *EXACT_KERNELS, *SCREEN_KERNELS)

SCREEN_MIN_GAIN = 1.5
"""The bf16 screen is chosen only when its product is this many times faster than the fastest
fp32 kernel. Screening costs more than its product: the reduced-precision tile is converted and
thresholded like an exact one, the candidates within the margin are listed too (1.2 times as
many at SOP scale) and all are re-scored. Measured at SOP scale (60,502 × 512, every retrieval
metric) on a 2-core AMD EPYC with AVX-512 BF16 (``benchmarks/RESULTS.md``, evaluation at SOP
scale): the fp32 product (OpenBLAS) was about 55 % of the 26 s search; with the screen, whose
product was 2.2 times faster, the search took 20 s, so the rest grew by about 12 % of the fp32
product's time. The screen therefore pays from a gain of about 1.2; 1.5 leaves room for the noise
of the start-up measurement (three products of one 1024² tile). CPUs with AMX (bf16 tiles) gain
far more."""

MEASURE_SIDE = 1024
"""Side of the test product of the measurement (capped at the tile side): large enough to reach
each library's steady speed, small enough to keep start-up well under a second."""

MEASURE_MIN_WORK = 10**10
"""``kernel="auto"`` measures only for a search of at least this many multiply-adds
(``queries × references × dim``; SOP's test set is 1.9·10¹²): below it the choice saves less than
the measurement costs, and torch computes."""

SCREEN_MIN_QUERIES = 1024
"""The screen converts the references to bfloat16 at every search: it is considered only when at
least this many queries share that conversion (an evaluation, not a few queries of a gallery)."""

MEASURE_REPEATS = 3
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24

Product = Callable[[Tensor, Tensor], Tensor]
"""``product(q (m, d), r (n, d)) → (m, n)`` scores, fp32 (or bfloat16 for a screen)."""


def screen_margin(dim: int, unit_roundoff: float = BF16_UNIT_ROUNDOFF) -> float:
    """``c`` of the module docstring: a bfloat16 screening score is within ``c·‖q‖‖r‖`` of the
    exact engine's fp32 score for vectors of dimension ``dim``."""
    u = unit_roundoff
    gamma = dim * FP32_UNIT_ROUNDOFF / (1 - dim * FP32_UNIT_ROUNDOFF)
    rounding_inputs = 2 * u + u * u
    accumulation = gamma * (1 + u) ** 2
    rounding_output = u * (1 + gamma) * (1 + u) ** 2
    return rounding_inputs + accumulation + rounding_output + gamma


# --------------------------------------------------------------------------- the products
def _torch_product(q: Tensor, r: Tensor) -> Tensor:
    return q @ r.T


def _openblas_product(q: Tensor, r: Tensor) -> Tensor:
    return torch.from_numpy(q.detach().numpy() @ r.detach().numpy().T)


def _faiss_product(q: Tensor, r: Tensor) -> Tensor:
    import faiss

    return torch.from_numpy(
        faiss.pairwise_distances(
            q.detach().numpy(), r.detach().numpy(), metric=faiss.METRIC_INNER_PRODUCT
        )
    )


def _bf16_product(q: Tensor, r: Tensor) -> Tensor:
    return q @ r.T


PRODUCTS: dict[str, Product] = {
    "torch": _torch_product,
    "openblas": _openblas_product,
    "faiss": _faiss_product,
    "bf16": _bf16_product,
}


def _available(name: str, device: torch.device) -> bool:
    if device.type != "cpu":
        return name == "torch"
    if name == "faiss":
        try:
            import faiss  # noqa: F401
        except ImportError:
            return False
    return True


@dataclass(frozen=True)
class ScoreKernels:
    """The kernels a search uses: ``exact`` computes fp32 scores; ``screen`` (or ``None``) lists
    candidates in reduced precision, within ``margin·‖q‖‖r‖`` of the exact scores."""

    exact: str = "torch"
    screen: str | None = None
    margin: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of the measured test product per kernel (empty when none was measured)."""

    def product(self, q: Tensor, r: Tensor) -> Tensor:
        """Exact fp32 scores ``q·rᵀ``."""
        return PRODUCTS[self.exact](q, r)

    def screen_product(self, q_low: Tensor, r_low: Tensor) -> Tensor:
        """Screening scores of the reduced-precision rows (see :meth:`lower`)."""
        assert self.screen is not None
        return PRODUCTS[self.screen](q_low, r_low)

    def lower(self, vectors: Tensor) -> Tensor:
        """The rows in the screen's precision (bfloat16)."""
        return vectors.to(torch.bfloat16)

    def threads(self, workers: int) -> AbstractContextManager[object]:
        """While the tiles run on ``workers`` threads, each single-threaded: BLAS libraries that
        keep their own thread pools (OpenBLAS, faiss's OpenMP) run one thread per call."""
        if workers <= 1 or self.exact == "torch":
            return nullcontext()
        from threadpoolctl import threadpool_limits

        return threadpool_limits(limits=1, user_api="blas")

    def describe(self) -> str:
        """e.g. ``'openblas (fp32), screened by bf16'``; with the measured times when known."""
        text = f"{self.exact} (fp32)"
        if self.screen is not None:
            text += f", screened by {self.screen} (margin {self.margin:.4f})"
        if self.timings:
            measured = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.timings.items())
            text += f"; measured {measured}"
        return text


# --------------------------------------------------------------------------- choosing
_CHOSEN: dict[tuple[str, int, int, int], ScoreKernels] = {}
_LOCK = threading.Lock()


def choose_kernels(
    device: torch.device,
    dim: int,
    block: int,
    requested: KernelName = "auto",
    screen: bool = True,
) -> ScoreKernels:
    """The kernels for tiles of ``block`` rows of dimension ``dim`` on ``device``.

    ``requested="auto"``: on CUDA, torch; on CPU, each available kernel is timed once per process
    on a test product of this shape, single-threaded as the tile workers run it, and the fastest
    fp32 kernel computes, with the bf16 screen when it gains at least :data:`SCREEN_MIN_GAIN`
    and stays within its error bound (``screen=False``: never, e.g. for a search of fewer than
    :data:`SCREEN_MIN_QUERIES` queries). A named kernel is used as asked (``bf16``: screened,
    exact by the fastest fp32 kernel); a kernel this machine lacks (faiss not installed, or
    anything but torch on CUDA) is a ``ValueError``.
    """
    if requested not in KERNEL_NAMES:
        raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {requested!r}")
    if requested != "auto" and not _available(requested, device):
        fix = "install faiss-cpu" if requested == "faiss" else "use kernel='auto' or 'torch'"
        raise ValueError(f"score kernel {requested!r} is not available on {device}; {fix}")
    if requested == "torch" or (requested == "auto" and device.type != "cpu"):
        return ScoreKernels("torch")
    if requested in EXACT_KERNELS:
        return ScoreKernels(requested)
    key = (requested, dim, min(block, MEASURE_SIDE), torch.get_num_threads())
    with _LOCK:
        if key not in _CHOSEN:
            _CHOSEN[key] = _measure_and_choose(dim, min(block, MEASURE_SIDE), requested)
        chosen = _CHOSEN[key]
    if not screen and requested == "auto" and chosen.screen is not None:
        return replace(chosen, screen=None, margin=0.0)
    return chosen


def _measure_and_choose(dim: int, side: int, requested: str) -> ScoreKernels:
    generator = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(side, dim, generator=generator), dim=1)
    r = torch.nn.functional.normalize(torch.randn(side, dim, generator=generator), dim=1)
    names = [n for n in (*EXACT_KERNELS, *SCREEN_KERNELS) if _available(n, torch.device("cpu"))]
    with ThreadPoolExecutor(1) as one:  # a fresh thread: single-threaded like a tile worker
        timings = one.submit(_time_kernels, names, q, r).result()
    exact = min((n for n in timings if n in EXACT_KERNELS), key=timings.__getitem__)
    margin = screen_margin(dim)
    screen = None
    if "bf16" in timings and _within_bound(q, r, margin):
        gain = timings[exact] / timings["bf16"]
        if requested == "bf16" or gain >= SCREEN_MIN_GAIN:
            screen = "bf16"
    if requested == "bf16" and screen is None:
        raise ValueError(
            "score kernel 'bf16': this machine's bfloat16 product exceeds the error bound of the "
            "screen (it does not accumulate in fp32); use kernel='auto'"
        )
    return ScoreKernels(exact, screen, margin if screen else 0.0, timings)


def _time_kernels(names: list[str], q: Tensor, r: Tensor) -> dict[str, float]:
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    timings = {}
    with threadpool_limits(limits=1, user_api="blas"):
        for name in names:
            a, b = (q.to(torch.bfloat16), r.to(torch.bfloat16)) if name == "bf16" else (q, r)
            product = PRODUCTS[name]
            try:
                product(a, b)  # warm-up: library loading, thread start, packing buffers
            except Exception:  # a kernel that fails here is simply not a candidate
                continue
            best = np.inf
            for _ in range(MEASURE_REPEATS):
                start = time.perf_counter()
                product(a, b)
                best = min(best, time.perf_counter() - start)
            timings[name] = best
    return timings


def _within_bound(q: Tensor, r: Tensor, margin: float) -> bool:
    """Whether this machine's bf16 product of the test rows keeps to the proven bound."""
    approx = _bf16_product(q.to(torch.bfloat16), r.to(torch.bfloat16)).double()
    exact = q.double() @ r.double().T
    return bool((approx - exact).abs().max() <= margin)


@dataclass(frozen=True)
class ScreenedRows:
    """Rows in the screen's precision with what the margin needs: ``‖x‖``, ``‖x̃‖``, ``‖x̃ − x‖``."""

    low: Tensor
    norm: Tensor
    low_norm: Tensor
    error: Tensor

    @classmethod
    def of(cls, rows: Tensor, chunk: int = 1 << 16) -> ScreenedRows:
        """The screen's copy of ``rows``, the norms computed a slice at a time (no float32
        temporaries of the whole set)."""
        low = rows.to(torch.bfloat16)
        norm, low_norm, error = (rows.new_empty(len(rows)) for _ in range(3))
        for start in range(0, len(rows), chunk):
            part = slice(start, start + chunk)
            wide = low[part].float()
            norm[part] = rows[part].norm(dim=1)
            low_norm[part] = wide.norm(dim=1)
            # x̃ − x is exact in fp32 (Sterbenz: the two are within a factor 2 of each other).
            error[part] = (wide - rows[part]).norm(dim=1)
        return cls(low, norm, low_norm, error)


@dataclass(frozen=True)
class Screen:
    """The bf16 screen of one search: reduced-precision tiles and the thresholds that make
    listing candidates on them exact (module docstring, "The screening margin")."""

    queries: ScreenedRows
    refs: ScreenedRows
    product: Product
    dim: int

    SLACK = 1 + 2.0**-10
    """Covers the fp32 rounding of the norms (relative ``d·2⁻²⁴``) and of the margin itself."""

    @classmethod
    def of(cls, queries: Tensor, refs: Tensor, kernels: ScoreKernels) -> Screen:
        q = ScreenedRows.of(queries)
        r = q if refs is queries else ScreenedRows.of(refs)
        assert kernels.screen is not None
        return cls(q, r, PRODUCTS[kernels.screen], queries.shape[1])

    def tile(self, rows: slice, cols: slice) -> Tensor:
        """The screening scores of the tile, in bfloat16 (listed as such:
        :func:`~idml.evaluation.search.candidates.candidates_bfloat16`)."""
        return self.product(self.queries.low[rows], self.refs.low[cols])

    def margins(self, rows: slice, cols: slice, transposed: bool) -> Tensor:
        """``m`` per query of one side of the tile (its rows, or its columns when ``transposed``)
        against every reference of the other side."""
        side_q, side_r = (self.refs, self.queries) if transposed else (self.queries, self.refs)
        q_slice, r_slice = (cols, rows) if transposed else (rows, cols)
        gamma = self.dim * FP32_UNIT_ROUNDOFF / (1 - self.dim * FP32_UNIT_ROUNDOFF)
        q_norm, q_low = side_q.norm[q_slice], side_q.low_norm[q_slice]
        q_err = side_q.error[q_slice]
        r_norm = side_r.norm[r_slice].max()
        r_low = side_r.low_norm[r_slice].max()
        r_err = side_r.error[r_slice].max()
        m = q_low * r_err + q_err * r_norm + gamma * (q_low * r_low + q_norm * r_norm)
        return m * self.SLACK

    @staticmethod
    def reach(threshold: Tensor, margin: Tensor) -> Tensor:
        """The screening score every pair whose exact score reaches ``threshold`` reaches."""
        shifted = threshold - margin
        return shifted - BF16_UNIT_ROUNDOFF * shifted.abs() * Screen.SLACK

    @staticmethod
    def lower_bound(screened: Tensor, margin: Tensor) -> Tensor:
        """The least exact score of a pair screened at ``screened``."""
        u = BF16_UNIT_ROUNDOFF
        return screened - u * screened.abs() / (1 - u) * Screen.SLACK - margin


def rescore_pairs(queries: Tensor, references: Tensor, q_local: Tensor, r_local: Tensor) -> Tensor:
    """Exact fp32 scores ``queries[q_local[j]] · references[r_local[j]]`` of a list of pairs
    sorted by query: one sampled product (``torch.sparse.sampled_addmm``) over the pattern of the
    pairs, which computes only the listed dot products and never gathers rows."""
    if len(q_local) == 0:
        return torch.empty(0, dtype=torch.float32, device=queries.device)
    counts = torch.bincount(q_local, minlength=queries.shape[0])
    crow = torch.zeros(queries.shape[0] + 1, dtype=torch.long, device=queries.device)
    crow[1:] = counts.cumsum(0)
    zeros = torch.zeros(len(q_local), dtype=queries.dtype, device=queries.device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        pattern = torch.sparse_csr_tensor(
            crow,
            r_local,
            zeros,
            size=(queries.shape[0], references.shape[0]),
            check_invariants=False,
        )
        return torch.sparse.sampled_addmm(pattern, queries, references.T).values()
