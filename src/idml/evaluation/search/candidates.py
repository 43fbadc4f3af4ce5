"""Sparse candidate lists: the scores of a tile that can still change a query's state.

A query's top-k changes only through scores at or above its current k-th score, and its relevant
ranks only through non-relevant scores at or above its least relevant score. Both are rare after
the first tiles, so one thresholding pass per tile side lists them as ``(query, reference, score)``
triples sorted by query, and all later work runs on that list.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from idml.evaluation.search.state import INF


def candidates(tile: Tensor, reach: Tensor, transposed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """All ``(query, reference, score)`` with ``score ≥ reach[query]``, sorted by query.

    Queries are the rows of ``tile`` (its columns when ``transposed``); ``reach`` has one entry per
    query. One comparison pass in the tile's memory order, then the positions of the hits. On CPU
    this runs in NumPy (:func:`candidates_numpy`), elsewhere in torch (:func:`candidates_torch`);
    both return the same lists.
    """
    if tile.device.type == "cpu":
        if tile.dtype == torch.bfloat16:
            return candidates_bfloat16(tile, reach, transposed)
        return candidates_numpy(tile, reach, transposed)
    return candidates_torch(tile, reach, transposed)


def candidates_torch(
    tile: Tensor, reach: Tensor, transposed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`candidates` with torch ops (any device)."""
    hit = tile >= (reach.unsqueeze(0) if transposed else reach.unsqueeze(1))
    major, minor = hit.nonzero(as_tuple=True)
    values = tile[major, minor].float()
    if not transposed:
        return major, minor, values
    order = minor.argsort(stable=True)
    return minor[order], major[order], values[order]


def candidates_numpy(
    tile: Tensor, reach: Tensor, transposed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`candidates` on CPU with NumPy, whose vectorised compare and ``flatnonzero`` take a
    third of the time of torch's, and whose stable sort of small integer keys is a radix sort."""
    major, minor, values = _list_at_or_above(tile.detach().numpy(), reach.numpy(), transposed)
    return major, minor, torch.from_numpy(values)


def candidates_bfloat16(
    tile: Tensor, reach: Tensor, transposed: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`candidates` on a bfloat16 tile (a screen's) on CPU, compared as 16-bit integers.

    A positive bfloat16's bit pattern, read as a signed 16-bit integer, is positive and orders
    like its value, and every negative value, ``-0`` and ``-inf`` read as negative integers. So
    when every threshold is positive, comparing the raw bits with the bits of the thresholds
    rounded to bfloat16 lists every score that reaches its threshold (and perhaps a few one step
    below it, which the caller's exact thresholds drop), reading half the bytes of a float32 tile
    and never converting it. Any other threshold falls back to :func:`candidates_numpy` on
    a float32 copy. Scores are returned as float32 (exactly: bfloat16 ⊂ float32).
    """
    # Rounded to nearest: the least bfloat16 at or above a threshold (then a bfloat16 score
    # reaches one exactly when it reaches the other) or the greatest below it (a superset).
    keys_bits = reach.to(torch.bfloat16).view(torch.int16)
    if not bool((keys_bits > 0).all()):
        return candidates_numpy(tile.float(), reach, transposed)
    major, minor, bits = _list_at_or_above(
        tile.view(torch.int16).numpy(), keys_bits.numpy(), transposed
    )
    return major, minor, torch.from_numpy(bits).view(torch.bfloat16).float()


def _list_at_or_above(
    scores: np.ndarray, bar: np.ndarray, transposed: bool
) -> tuple[Tensor, Tensor, np.ndarray]:
    """``(query, reference, score)`` of the entries of ``scores`` at or above their query's
    ``bar`` (queries along the rows, or the columns when ``transposed``), sorted by query."""
    flat = np.flatnonzero(scores >= (bar[None, :] if transposed else bar[:, None]))
    values = scores.reshape(-1)[flat]
    major, minor = np.divmod(flat, scores.shape[1])
    if transposed:
        narrow = np.int16 if scores.shape[1] <= np.iinfo(np.int16).max else np.int32
        order = np.argsort(minor.astype(narrow), kind="stable")
        major, minor, values = minor[order], major[order], values[order]
    return torch.from_numpy(major), torch.from_numpy(minor), values


def pad_by_row(
    q_local: Tensor, values: Tensor, extra: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Group a row-sorted sparse list into a padded ``(rows, max per row)`` matrix.

    Returns the distinct rows, the values padded with ``-inf`` and, if given, ``extra`` padded with
    the largest long (so pads sort after every real index).
    """
    rows, counts = torch.unique_consecutive(q_local, return_counts=True)
    width = int(counts.max())
    which = torch.repeat_interleave(torch.arange(len(rows), device=values.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(values), device=values.device) - starts[which]
    padded = values.new_full((len(rows), width), -INF)
    padded[which, slot] = values
    padded_extra = None
    if extra is not None:
        padded_extra = extra.new_full((len(rows), width), torch.iinfo(torch.long).max)
        padded_extra[which, slot] = extra
    return rows, padded, padded_extra
