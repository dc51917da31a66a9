import torch
import torch.nn as nn


class Model(nn.Module):
    """A problem that does not build: 6 input channels cannot be split into 4 groups."""

    def __init__(self, in_channels, out_channels, kernel_size, groups):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, groups=groups)
        self.norm = nn.GroupNorm(groups, out_channels)

    def forward(self, x):
        return self.norm(self.conv(x))


batch_size = 2
in_channels = 6
out_channels = 8
kernel_size = 3
groups = 4


def get_inputs():
    return [torch.rand(batch_size, in_channels, 8, 8)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, groups]
