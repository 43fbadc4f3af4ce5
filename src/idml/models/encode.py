"""Embedding a whole image dataset: the one loop behind training-time evaluation, ``idml embed``,
``idml index`` and ``idml search`` (through the ``Encoder``), reports and the classifier's test pass.

:func:`embed_dataset` runs the model in eval mode without gradients over the dataset in its order,
``batch_size`` images at a time, reports progress through :mod:`idml.progress` and returns the
semantic (and uncertainty) embeddings on the CPU in float32 with the labels the dataset gives.
What a caller computes besides from each batch (a classifier's logits, ``||u||`` of altered
images) it does in ``on_batch``, which sees the batch on the device, so nothing is embedded twice.
Distributed evaluation embeds each process's shard with it and gathers afterwards
(:mod:`idml.app.distributed`).

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> from idml.models import build_model
    >>> model = build_model("small_cnn", pretrained=False, embedding_dim=4, uncertainty=True)
    >>> data = TensorDataset(torch.rand(5, 3, 8, 8), torch.tensor([0, 0, 1, 1, 2]), torch.arange(5))
    >>> embeddings, labels = embed_dataset(model, data, batch_size=2, device=torch.device("cpu"))
    >>> tuple(embeddings.semantic.shape), tuple(embeddings.uncertainty.shape), labels.tolist()
    ((5, 4), (5, 4), [0, 0, 1, 1, 2])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from idml.data.datasets import dataset_length
from idml.embeddings import Embeddings
from idml.progress import Progress

BatchHook = Callable[[Tensor, Tensor, Embeddings], object]
"""``on_batch(images, labels, embeddings)``: one batch on the device, after the model ran on it."""


@torch.no_grad()
def embed_dataset(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int,
    device: torch.device,
    *,
    progress: bool = False,
    num_workers: int = 0,
    on_batch: BatchHook | None = None,
) -> tuple[Embeddings, Tensor]:
    """The embeddings of every item of ``dataset``, in dataset order, and their labels.

    Args:
        model: images ``(B, C, H, W)`` on ``device`` → :class:`~idml.embeddings.Embeddings` (an
            :class:`~idml.models.EmbeddingModel`); put in eval mode for the pass, then restored.
        dataset: yields ``(image, label, index)`` (the datasets of :mod:`idml.data`).
        batch_size: images per forward pass.
        device: where the model runs.
        progress: a bar on a terminal, plain lines in a log (:mod:`idml.progress`).
        num_workers: DataLoader worker processes decoding images.
        on_batch: called with each batch's images, labels and embeddings on ``device``.

    Returns:
        ``(embeddings, labels)``: float32 on the CPU, ``uncertainty`` ``None`` for a model without
        an uncertainty head.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if dataset_length(dataset, "embedding a dataset") == 0:
        raise ValueError("the dataset to embed holds no images")
    was_training = model.training
    model.eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    semantic, uncertainty, labels = [], [], []
    bar = Progress(len(loader), "embed", enabled=progress, unit="batch")
    try:
        for images, batch_labels, _ in loader:
            images = images.to(device)
            emb = model(images)
            if on_batch is not None:
                on_batch(images, torch.as_tensor(batch_labels).to(device), emb)
            bar.update(1)
            semantic.append(emb.semantic.float().cpu())
            if emb.uncertainty is not None:
                uncertainty.append(emb.uncertainty.float().cpu())
            labels.append(torch.as_tensor(batch_labels))
    finally:
        bar.close()
        model.train(was_training)
    unc = torch.cat(uncertainty) if uncertainty else None
    return Embeddings(torch.cat(semantic), unc), torch.cat(labels)
