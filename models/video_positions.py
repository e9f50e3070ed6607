"""Absolute positions for the video tokens (`model.absolute_video_positions`).

Wan places its video tokens with RoPE, which rotates queries and keys only: a video token's value,
which is what an action token receives when it attends to it, says what the token shows and not
where it is. An action token that must reach a cube has to recover the cube's place from where
its attention weights fall, with the few rotary frequencies a head holds. This module adds where
to the values: each token's (row, column), as a fraction of the latent grid, in sin-cos features,
projected to the video width by a linear layer that starts at zero, so a model built with it
computes what one built without it does until training moves the projection.
"""
import torch
import torch.nn.functional as F
from torch import nn

FREQUENCIES = 6
"""Sin-cos octaves per axis: periods from twice the grid down to a sixteenth of it (2.5 tokens of
the 30x40 grid of the full-size model at 480x640)."""


class VideoPositions(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        # zeros drawn from no generator: the other parts' initial weights are those of a model without it
        self.weight = nn.Parameter(torch.zeros(width, 4 * FREQUENCIES))

    def forward(self, frames: int, height: int, width: int) -> torch.Tensor:
        """[1, frames * height * width, video width], in the order of Wan's flattened patch
        embedding (frame, row, column): the same (row, column) embedding in every latent frame."""
        device = self.weight.device
        octaves = torch.pi * 2.0 ** torch.arange(FREQUENCIES, device=device, dtype=torch.float32)
        rows = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) / height
        cols = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) / width
        r = (rows[:, None] * octaves).unsqueeze(1).expand(height, width, FREQUENCIES)
        c = (cols[:, None] * octaves).unsqueeze(0).expand(height, width, FREQUENCIES)
        features = torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], dim=-1).flatten(0, 1)
        return F.linear(features.to(self.weight.dtype), self.weight).repeat(frames, 1).unsqueeze(0)
