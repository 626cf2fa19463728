"""The ViT's stems: images -> tokens in the model's layout (batch first or second), by one
patchify convolution or by a stack of strided convolutions (Xiao et al. 2021)."""

import torch
from torch import nn


def _to_tokens(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """Feature map (N, D, h, w) -> tokens (N, h*w, D) or (h*w, N, D), row-major over the grid.

    Contiguous in the token layout: as a view of the feature map the features would have stride
    h*w, and elementwise ops keep an input's strides, so the whole residual stream would inherit
    them and every LayerNorm and Linear of every block would copy its input first.
    """
    x = x.flatten(2)
    return (x.transpose(1, 2) if batch_first else x.permute(2, 0, 1)).contiguous()


class PatchifyStem(nn.Module):
    """The original ViT stem: one conv with kernel = stride = patch size (bias optional)."""

    def __init__(
        self,
        *,
        in_channels: int,
        width: int,
        patch_size: int,
        batch_first: bool = True,
        bias: bool = True,
    ):
        super().__init__()
        self.batch_first = batch_first
        self.proj = nn.Conv2d(
            in_channels, width, kernel_size=patch_size, stride=patch_size, bias=bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _to_tokens(self.proj(x), self.batch_first)


class ConvBnReLU(nn.Module):
    """Conv (no bias: BatchNorm has its own shift) + BatchNorm + ReLU, 'same'-style padding."""

    def __init__(self, *, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size=kernel_size,
            stride=stride,
            padding=(kernel_size - 1) // 2,
            bias=False,
        )
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class ConvStem(nn.Module):
    """Stack of strided convs then a 1x1 conv to ``width``.

    From "Early convolutions help transformers see better" (Xiao et al., 2021): replacing the
    patchify conv with a few 3x3 convs makes ViT training far less sensitive to the optimizer.
    With odd kernels and padding (k - 1) // 2 each conv maps a side H to ceil(H / stride), so
    when the strides multiply to the patch size the grid matches the patchify stem's.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        width: int,
        channels: tuple[int, ...],
        kernels: tuple[int, ...],
        strides: tuple[int, ...],
        batch_first: bool = True,
    ):
        super().__init__()
        self.batch_first = batch_first
        layers = []
        for out_channels, kernel, stride in zip(channels, kernels, strides):
            layers.append(
                ConvBnReLU(
                    in_channels=in_channels,
                    out_channels=out_channels,
                    kernel_size=kernel,
                    stride=stride,
                )
            )
            in_channels = out_channels
        self.body = nn.Sequential(*layers)
        self.proj = nn.Conv2d(in_channels, width, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _to_tokens(self.proj(self.body(x)), self.batch_first)
