"""The model API for research code: swapping the classifier, complexity of the model as it is,
documented defaults shared by the zoo, the class and the config."""

import inspect

import pytest
import torch
from torch import nn

from pycls import config
from pycls.models import VisionTransformer
from pycls.models.vit import variants as vit_zoo


def _tiny(**kw):
    args = dict(image_size=16, patch_size=4, depth=1, width=32, num_heads=2, mlp_dim=64)
    return VisionTransformer(**{**args, "num_classes": 10, **kw})


CONV = dict(conv_stem_channels=(8, 16), conv_stem_kernels=(3, 3), conv_stem_strides=(2, 2))


def _params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_reset_classifier(classifier):
    model = _tiny(classifier=classifier)
    x = torch.randn(2, 3, 16, 16)
    features = model.forward_head(model.forward_features(x), pre_logits=True)
    model.reset_classifier(7)
    assert model.num_classes == 7 and model(x).shape == (2, 7)
    w, b = model.head.weight.detach(), model.head.bias.detach()
    assert float(b.abs().max()) == 0.0 and 0 < float(w.std()) < 0.05
    assert model.complexity()["params"] == _params(model)
    model.reset_classifier(0)  # features only, as timm
    assert isinstance(model.head, nn.Identity) and model.num_classes == 0
    torch.testing.assert_close(model(x), features)
    assert model.complexity()["params"] == _params(model)
    own = "token" if classifier == "token" else "avg"
    model.reset_classifier(3, global_pool=own)
    with pytest.raises(ValueError, match="global_pool"):
        model.reset_classifier(3, global_pool="avg" if own == "token" else "token")


def test_complexity_counts_a_head_assigned_directly():
    with torch.device("meta"):  # shapes only: nothing allocated or initialised
        model = vit_zoo.vit_b16()
        model.head = nn.Linear(768, 10)
        reference = vit_zoo.vit_b16(num_classes=10).complexity()
    cx = model.complexity()
    assert cx["params"] == _params(model) == 85_806_346
    assert cx == reference


def test_zoo_functions_are_documented():
    for name in vit_zoo.list_vit_models():
        doc = inspect.getdoc(getattr(vit_zoo, name))
        assert doc and "class token" in doc and "224 px" in doc, name


def test_one_default_for_classifier_and_layout():
    defaults = inspect.signature(VisionTransformer).parameters
    cfg = config.get_default_cfg()
    assert defaults["classifier"].default == cfg.VIT.CLASSIFIER == "token"
    assert defaults["layout"].default == cfg.VIT.LAYOUT == "batch_first"
    model = vit_zoo.vit_ti16()
    assert model.classifier == "token" and model.layout == "batch_first"


@pytest.mark.parametrize("classifier", ["token", "pooled"])
@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
@pytest.mark.parametrize("image_size", [16, 24])  # the stored table, and one resampled for it
def test_gradients_have_the_parameters_strides(classifier, layout, image_size):
    """DDP's gradient buckets expect each gradient laid out like its parameter (otherwise every
    rank warns "Grad strides do not match bucket view strides" and copies)."""
    model = _tiny(classifier=classifier, layout=layout, stem="conv", **CONV)
    model(torch.randn(2, 3, image_size, image_size)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad.stride() == p.stride(), name
