"""Layers shared by the convolutional families (AnyNet, RegNet, ResNet, EfficientNet).

Everything takes explicit arguments: the batch-norm settings and the activation travel in one
small ``LayerOptions`` value from the model's keyword arguments down to every layer, so two
models with different settings can live in one process.

``Cx`` is the analytic complexity counter the families share. It counts as upstream pycls does
(its ``dev/model_complexity.json`` is the reference the tests hold us to):

- ``flops``: multiply-adds of every convolution and linear layer, plus one addition per output
  element for a layer with a bias (upstream counts the bias; the ViT's count in
  ``pycls.models.vit.complexity`` does not). Norms, activations, pooling and residual additions are
  free.
- ``params``: every trainable parameter (two per batch-norm channel).
- ``acts``: output elements of every convolution, linear and max-pooling layer.
"""

import dataclasses
import math

import torch
from torch import nn

ACTIVATIONS = ("relu", "silu", "swish", "gelu")


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """Batch-norm epsilon and momentum (PyTorch's convention: the weight of the new batch) and
    the activation ("relu", "silu"/"swish" or "gelu"; ReLU optionally in place)."""

    bn_eps: float = 1e-5
    bn_momentum: float = 0.1
    activation: str = "relu"
    activation_inplace: bool = True

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r}; expected one of {ACTIVATIONS}"
            )


def conv2d(w_in: int, w_out: int, k: int, *, stride: int = 1, groups: int = 1, bias: bool = False):
    """A k x k convolution padded to keep ceil(side / stride); odd k only (as upstream)."""
    if k % 2 == 0:
        raise ValueError(f"only odd kernel sizes keep the padding symmetric, got {k}")
    return nn.Conv2d(w_in, w_out, k, stride=stride, padding=(k - 1) // 2, groups=groups, bias=bias)


def norm2d(w: int, opts: LayerOptions) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(w, eps=opts.bn_eps, momentum=opts.bn_momentum)


def activation(opts: LayerOptions) -> nn.Module:
    if opts.activation == "relu":
        return nn.ReLU(inplace=opts.activation_inplace)
    if opts.activation in ("silu", "swish"):
        return nn.SiLU()
    return nn.GELU()


def final_norm2d(w: int, opts: LayerOptions) -> nn.BatchNorm2d:
    """The last norm of a residual branch: ``init_cnn_weights`` may start its scale at zero, so
    that each residual block begins as the identity ("Bag of tricks", Goyal et al.)."""
    bn = norm2d(w, opts)
    bn.final_bn = True
    return bn


class SE(nn.Module):
    """Squeeze-and-excitation: global average, 1x1 conv, activation, 1x1 conv, sigmoid gate."""

    def __init__(self, w_in: int, w_se: int, opts: LayerOptions):
        super().__init__()
        self.avg_pool = nn.AdaptiveAvgPool2d((1, 1))
        self.f_ex = nn.Sequential(
            conv2d(w_in, w_se, 1, bias=True),
            activation(opts),
            conv2d(w_se, w_in, 1, bias=True),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.f_ex(self.avg_pool(x))


def init_cnn_weights(model: nn.Module, *, zero_init_final_gamma: bool = False) -> None:
    """He (fan-out) normal convolutions, unit/zero batch norms, N(0, 0.01) linear layers.

    Upstream's initialisation: a convolution's fan-out is k * k * out_channels whatever its
    groups, and a convolution's bias (the SE layers') keeps PyTorch's default.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
            nn.init.normal_(m.weight, mean=0.0, std=math.sqrt(2.0 / fan_out))
        elif isinstance(m, nn.BatchNorm2d):
            zero = zero_init_final_gamma and getattr(m, "final_bn", False)
            nn.init.constant_(m.weight, 0.0 if zero else 1.0)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.01)
            nn.init.zeros_(m.bias)


def drop_connect(x: torch.Tensor, drop_ratio: float) -> torch.Tensor:
    """Zeroes whole samples of a residual branch with probability ``drop_ratio`` and scales the
    survivors by 1 / (1 - drop_ratio) (EfficientNet's drop connect, i.e. stochastic depth)."""
    keep = 1.0 - drop_ratio
    mask = x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class Head(nn.Module):
    """The families' classifier: an optional 1x1 conv + BN + activation (``head_w`` > 0), global
    average pooling, optional dropout, a linear layer. ``norm_name`` is the BN's name in the
    family's checkpoints (AnyNet's ``bn``, EfficientNet's ``conv_bn``)."""

    def __init__(self, w_in, head_w, num_classes, opts, *, dropout_ratio=0.0, norm_name="bn"):
        super().__init__()
        self.head_width, self.norm_name = head_w, norm_name
        if head_w > 0:
            self.conv = conv2d(w_in, head_w, 1)
            self.add_module(norm_name, norm2d(head_w, opts))
            self.af = activation(opts)
            w_in = head_w
        self.avg_pool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=dropout_ratio) if dropout_ratio > 0 else None
        self.fc = nn.Linear(w_in, num_classes, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_width > 0:
            x = self.af(getattr(self, self.norm_name)(self.conv(x)))
        x = torch.flatten(self.avg_pool(x), 1)
        if self.dropout is not None:
            x = self.dropout(x)
        return self.fc(x)

    @staticmethod
    def complexity(cx: "Cx", w_in: int, head_w: int, num_classes: int) -> "Cx":
        if head_w > 0:
            cx.conv(w_in, head_w, 1).norm(head_w)
            w_in = head_w
        return cx.gap().linear(w_in, num_classes)


class ConvNet(nn.Module):
    """What the CNN families share: ``stem``, stages ``s1``, ``s2``, ... and ``head`` (whose
    ``fc`` classifies), applied in order, initialised as upstream initialises them; ``arch``
    holds every argument the family's analytic complexity (``count``) takes, so that
    ``complexity()`` cannot drift from the network built.

    A convolutional network takes any image size: ``image_size`` only sets the default of
    ``complexity()`` and the size the trainer's engines assume (the image-size curriculum calls
    ``set_image_size``; nothing needs resampling).
    """

    image_size: int = 224
    # Arguments that leave the parameters (names, shapes, what they compute) as they are: a
    # checkpoint resumes under other values
    TRAINING_ONLY_ARGS = frozenset(
        {"bn_momentum", "zero_init_final_gamma", "activation_inplace", "dc_ratio", "dropout_ratio"}
    )
    # The family's complexity function: count(image_size=..., **arch) -> dict(flops, params, acts)
    count = None

    def __init__(self, stem, stages, head, *, arch: dict, zero_init_final_gamma: bool = False):
        super().__init__()
        self.arch = arch
        self.stem = stem
        for i, stage in enumerate(stages):
            self.add_module(f"s{i + 1}", stage)
        self.head = head
        init_cnn_weights(self, zero_init_final_gamma=zero_init_final_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            x = module(x)
        return x

    def set_image_size(self, image_size: int, optimizer=None, ema=None) -> None:
        """Records the size (nothing depends on it; ``optimizer`` and ``ema`` as the ViT takes
        them are not touched)."""
        if image_size <= 0:
            raise ValueError(f"image_size must be positive, got {image_size}")
        self.image_size = image_size

    def complexity(self, image_size: int | None = None) -> dict[str, int]:
        """Per-image ``dict(flops, params, acts)`` (see ``Cx``), at ``image_size`` or the
        network's own."""
        return type(self).count(image_size=image_size or self.image_size, **self.arch)

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def repeated_blocks(self) -> list[nn.Module]:
        """The blocks of every stage, in order: the units FSDP shards one at a time and
        regional compilation compiles one by one."""
        return [
            b
            for name, s in self.named_children()
            if name[0] == "s" and name[1:].isdigit()
            for b in s.children()
        ]

    @property
    def num_classes(self) -> int:
        return self.head.fc.out_features


class Cx:
    """Running (flops, params, acts) of a network at the current spatial size (h, w).

    Each method adds one layer's cost and moves (h, w) to the layer's output size; a branch that
    runs beside the main path (a projection shortcut, SE) saves and restores the size with
    ``branch()``.
    """

    def __init__(self, h: int, w: int):
        self.h, self.w = h, w
        self.flops = self.params = self.acts = 0

    def conv(self, w_in, w_out, k, *, stride=1, groups=1, bias=False) -> "Cx":
        self.h, self.w = (self.h - 1) // stride + 1, (self.w - 1) // stride + 1
        hw = self.h * self.w
        self.flops += k * k * w_in * w_out * hw // groups + (w_out * hw if bias else 0)
        self.params += k * k * w_in * w_out // groups + (w_out if bias else 0)
        self.acts += w_out * hw
        return self

    def norm(self, w: int) -> "Cx":
        self.params += 2 * w
        return self

    def max_pool(self, w: int, k: int, *, stride: int) -> "Cx":
        self.h, self.w = (self.h - 1) // stride + 1, (self.w - 1) // stride + 1
        self.acts += w * self.h * self.w
        return self

    def gap(self) -> "Cx":
        self.h = self.w = 1
        return self

    def linear(self, w_in: int, w_out: int, *, bias: bool = True) -> "Cx":
        self.flops += w_in * w_out + (w_out if bias else 0)
        self.params += w_in * w_out + (w_out if bias else 0)
        self.acts += w_out
        return self

    def se(self, w_in: int, w_se: int) -> "Cx":
        h, w = self.h, self.w
        self.gap().conv(w_in, w_se, 1, bias=True).conv(w_se, w_in, 1, bias=True)
        self.h, self.w = h, w
        return self

    def shortcut(self, w_in: int, w_out: int, *, stride: int) -> "Cx":
        """A 1x1 projection + BN beside the residual branch (the size is the branch's to move)."""
        h, w = self.h, self.w
        self.conv(w_in, w_out, 1, stride=stride).norm(w_out)
        self.h, self.w = h, w
        return self

    def totals(self) -> dict[str, int]:
        return {"flops": self.flops, "params": self.params, "acts": self.acts}
