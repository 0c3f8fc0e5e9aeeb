"""Small models the CPU pool suites share: torchvision's BasicBlock ResNet (BatchNorm, in-place ReLU)."""

import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """torchvision's: BatchNorm, and an in-place ReLU on the residual sum."""

    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        y += x
        return self.relu(y)


class ResNet(nn.Module):
    def __init__(self, c=8, blocks=4):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(*[BasicBlock(c) for _ in range(blocks)])
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))
