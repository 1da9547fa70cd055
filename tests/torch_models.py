"""Small torch modules for the export tests (imported only when torch is installed)."""

from __future__ import annotations

import torch
from torch import nn


class TinyClassifier(nn.Module):
    """Conv + BatchNorm + Dropout: wrong in train mode, so an export that skips eval() shows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.features[1].running_mean.uniform_(-0.5, 0.5)
            self.features[1].running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


def make_classifier() -> nn.Module:
    model = TinyClassifier()
    model.train()  # deliberately left in training mode: the exporter must force eval()
    return model
