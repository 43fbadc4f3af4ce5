"""How a training step uses its device: :class:`ComputePlan`, resolved from ``optim`` for one device.

On an accelerator the defaults are the ones that pay there: autocast in bfloat16 where the device
has it (float16 with loss scaling where it does not), the model and the image batches in
channels-last memory format (convolutions then run without layout transposes), the optimizer's
fused kernel (one launch for every parameter), and the host reading the step's values only every
``sync_every`` steps: a read of a device tensor waits for every queued kernel, so a read per step
leaves the device idle while the host prepares the next one. ``torch.compile`` of the backbone is
an option (``optim.compile``): it costs a compilation at the start and at every new batch shape.

On the CPU the defaults keep float32 and torch's default optimizer kernel (a loop over the
parameters there), and read every step (a CPU tensor is ready when its operation returns, so
reading costs nothing); they too put the model and the batches in channels-last memory format,
which oneDNN's CPU convolutions run faster than the default layout (``benchmarks/RESULTS.md``,
"Channels-last on the CPU"): the same float32 sums in another order. Each choice can still be
forced (``amp_dtype=bfloat16``, ``channels_last=false``, ``fused=true``, ``sync_every=N``), e.g.
to reproduce a run trained before channels-last was the CPU's default.

Example:
    >>> import torch
    >>> from idml.app.config import OptimConfig
    >>> plan = ComputePlan.resolve(OptimConfig(), torch.device("cpu"))
    >>> plan.describe(), plan.sync_every
    ('channels-last', 1)
    >>> plan = ComputePlan.resolve(OptimConfig(), torch.device("cuda"), bf16_supported=lambda: True)
    >>> plan.describe()
    'bfloat16 autocast, channels-last, fused optimizer, host reads every 25 steps'
    >>> plan.loss_scaling
    False
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from idml.app.config import OptimConfig
    from idml.models import EmbeddingModel

ACCELERATOR_SYNC_EVERY = 25
"""``optim.sync_every=auto`` on an accelerator: the host reads the step's values this often (a
delay of a few steps in catching a NaN, against one device drain per step)."""

CHANNELS_LAST_DEVICES = frozenset({"cuda", "cpu"})
"""Where ``optim.channels_last=auto`` uses channels-last: cuDNN and oneDNN convolutions take that
layout natively (on CUDA with autocast it feeds the tensor cores without transposes)."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def uses_channels_last(optim: OptimConfig, device: torch.device) -> bool:
    """Whether a run with ``optim`` puts its model in channels-last memory format on ``device``
    (``optim.channels_last``; ``auto``: on :data:`CHANNELS_LAST_DEVICES`). Training and every
    later load of the run's model ask the same question, so that the same device computes the
    same embeddings for both."""
    if optim.channels_last == "auto":
        return device.type in CHANNELS_LAST_DEVICES
    return bool(optim.channels_last)


class ComputeSettingError(ValueError):
    """An ``optim`` compute setting this machine cannot run; the message names the key."""


@dataclass(frozen=True)
class ComputePlan:
    """The compute choices of one run on one device (:meth:`resolve` reads them from ``optim``).

    Attributes:
        device: where the step runs.
        autocast_dtype: the autocast dtype, or ``None`` for float32.
        channels_last: model and 4-D image batches in channels-last memory format.
        compile_mode: ``torch.compile`` mode of the backbone, or ``None`` (eager).
        fused: the optimizer's fused kernel.
        sync_every: the host reads the step's logged values (and checks for NaN) every this many
            steps.
    """

    device: torch.device
    autocast_dtype: torch.dtype | None
    channels_last: bool
    compile_mode: str | None
    fused: bool
    sync_every: int

    @classmethod
    def resolve(
        cls,
        optim: OptimConfig,
        device: torch.device,
        bf16_supported: Callable[[], bool] | None = None,
    ) -> ComputePlan:
        """The plan of ``optim`` on ``device``; ``bf16_supported`` answers for a CUDA device
        (default :func:`torch.cuda.is_bf16_supported`; given in tests, which have no GPU)."""
        accelerator = device.type != "cpu"
        dtype: torch.dtype | None = None
        if optim.amp:
            if optim.amp_dtype != "auto":
                dtype = _DTYPES[optim.amp_dtype]
            elif device.type == "cuda":
                supported = bf16_supported or torch.cuda.is_bf16_supported
                dtype = torch.bfloat16 if supported() else torch.float16
            elif accelerator:
                dtype = torch.float16
        if dtype is not None and not torch.amp.is_autocast_available(device.type):
            raise ComputeSettingError(
                f"optim.amp_dtype={optim.amp_dtype}: torch has no autocast for device "
                f"{device.type!r}; set optim.amp=false"
            )
        compile_mode = None if optim.compile == "off" else optim.compile
        if compile_mode is not None:
            _check_compiler(device, optim.compile)
        return cls(
            device=device,
            autocast_dtype=dtype,
            channels_last=uses_channels_last(optim, device),
            compile_mode=compile_mode,
            fused=accelerator if optim.fused == "auto" else bool(optim.fused),
            sync_every=(ACCELERATOR_SYNC_EVERY if accelerator else 1)
            if optim.sync_every == "auto"
            else int(optim.sync_every),
        )

    @property
    def loss_scaling(self) -> bool:
        """float16 needs the loss scaled (its range underflows small gradients); bfloat16 does not."""
        return self.autocast_dtype == torch.float16

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The forward pass's autocast (a no-op in float32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """The loss scaler (disabled unless :attr:`loss_scaling`)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.loss_scaling)

    def prepare_model(self, model: EmbeddingModel) -> None:
        """Move ``model``'s weights to the memory format and compile its backbone, in place (the
        parameters stay the same objects and the state-dict keys the same names, so optimizers,
        checkpoints and exports see no difference)."""
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        if self.compile_mode is not None:
            model.backbone.compile(mode=self.compile_mode)

    def prepare_images(self, images: Tensor) -> Tensor:
        """A batch in the plan's memory format."""
        if self.channels_last and images.dim() == 4:
            return images.contiguous(memory_format=torch.channels_last)
        return images

    def reads_at(self, step: int, steps: int) -> bool:
        """Whether the host reads after step ``step`` (from 0) of an epoch of ``steps``: every
        :attr:`sync_every` steps and at the epoch's last step."""
        return (step + 1) % self.sync_every == 0 or step + 1 >= steps

    def describe(self) -> str:
        """What the step does beyond a float32 eager step read every step, for the start-up
        summary (empty for such a step)."""
        parts = []
        if self.autocast_dtype is not None:
            parts.append(f"{_name(self.autocast_dtype)} autocast")
        if self.channels_last:
            parts.append("channels-last")
        if self.fused:
            parts.append("fused optimizer")
        if self.compile_mode is not None:
            parts.append(f"torch.compile ({self.compile_mode})")
        if self.sync_every > 1:
            parts.append(f"host reads every {self.sync_every} steps")
        return ", ".join(parts)


def _check_compiler(device: torch.device, mode: str) -> None:
    """Refuse ``optim.compile`` where torch.compile cannot generate code, before training starts
    (it would fail inside the first step, deep in the compiler)."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise ComputeSettingError(
            f"optim.compile={mode} on the CPU needs a C++ compiler (c++, g++ or clang++ on PATH); "
            "install one (apt-get install g++) or set optim.compile=off"
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ComputeSettingError(
            f"optim.compile={mode} on CUDA needs the triton package (pip install triton), or set "
            "optim.compile=off"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
